//! Which compiled variant of the SIMT kernels a call runs: the head width it is compiled for,
//! the vector width of its loads, and its block and tile sizes — by a stated rule, per kernel:
//!
//! 1. the head width: the narrowest of [`WIDTHS`] that holds `head_dim` (wider heads: the next
//!    multiple of 64), so that a handful of compiled widths serve every model;
//! 2. the vector: the widest of 4, 2, 1 elements (16 bytes of `f32`) that divides `head_dim`;
//! 3. the lanes over a row: 8 (16 from width 256, 4 where the head's vectors are not a multiple
//!    of 8), so that a unit's share of the head stays a few dozen registers;
//! 4. the block and the tile: of the blocks up to the fewest rows that hold the call's rows (a
//!    decoding step's few queries and heads; at most [`MAX_BLOCK`]) and the tiles of [`TILES`],
//!    the pair whose shared memory fits the device's with the fewest shared-memory reads per
//!    product, `1/block + 1/tile` (each product reads a block row and a tile row); the larger
//!    block on a tie.
//!
//! A test can fix the block and tile instead ([`TileRule::Fixed`]), so that every variant is run
//! directly, not only those the rule picks for the test's shapes.

use super::simt::{Tiling, UNIT_ROWS};

/// The head widths the kernels are compiled for (the widths models use).
const WIDTHS: [usize; 5] = [64, 80, 96, 128, 256];
/// The most rows of a block.
const MAX_BLOCK: u32 = 64;
/// Tile lengths, longest first.
pub(crate) const TILES: [u32; 3] = [32, 16, 8];
// A tile spans at most two pages: the paged tile load reads two entries of a table.
const _: () = assert!(crate::PagePool::MIN_PAGE_SIZE >= TILES[0] as usize);

/// How a call's blocks and tiles are chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TileRule {
    /// By this module's rule.
    Auto,
    /// This block and tile for every kernel of the call: the tests' variants (`forced.rs`), and a
    /// ragged step's launch at the tiling its work list was cut by.
    Fixed { block: u32, tile: u32 },
}

/// Which kernel a tiling is for: their shared memory differs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pass {
    Forward,
    QueryGrad,
    KeyValueGrad,
}

/// The sizes a tiling is chosen from.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sizes {
    pub head_dim: usize,
    /// Bytes of the input's float type.
    pub element: usize,
    /// Rows the block's side has: (query, query head) pairs of a group, or keys.
    pub rows: usize,
    /// The vector width of the loads ([`vector_size`]).
    pub vector: usize,
    /// The device's shared memory per cube, bytes, and its most units per cube.
    pub shared_memory: usize,
    pub max_units: u32,
}

/// The compiled head width for `head_dim`.
pub(crate) fn compiled_width(head_dim: usize) -> u32 {
    let width = WIDTHS
        .into_iter()
        .find(|&width| width >= head_dim)
        .unwrap_or_else(|| head_dim.next_multiple_of(64));
    width as u32
}

/// The widest vector (at most `max`) that divides `head_dim`.
pub(crate) fn vector_size(head_dim: usize, max: usize) -> usize {
    [4, 2, 1]
        .into_iter()
        .find(|&size| size <= max && head_dim.is_multiple_of(size))
        .expect("1 divides every width")
}

fn lanes(width: u32, vector: u32) -> u32 {
    if width >= 256 {
        16
    } else if (width / vector).is_multiple_of(8) {
        8
    } else {
        4
    }
}

/// The tiling of `pass` for a call of `sizes` under `rule`.
///
/// # Panics
/// When a fixed block and tile do not divide as the kernels need or do not fit the device
/// (tests only), or when no tiling fits the device (shared memory below a few KiB).
pub(crate) fn tiling(pass: Pass, sizes: Sizes, rule: TileRule) -> Tiling {
    let width = compiled_width(sizes.head_dim);
    let lanes = lanes(width, sizes.vector as u32);
    let tiling = |block, tile| Tiling {
        width,
        block,
        tile,
        lanes,
    };
    let fits = |tiling: &Tiling| {
        tiling.tile >= lanes
            && tiling.tile.is_multiple_of(lanes)
            && tiling.block.is_multiple_of(UNIT_ROWS)
            && tiling.units() <= sizes.max_units
            && shared_memory(pass, tiling, sizes.element, sizes.vector) <= sizes.shared_memory
    };
    if let TileRule::Fixed { block, tile } = rule {
        let fixed = tiling(block, tile);
        assert!(fits(&fixed), "{fixed:?} does not fit {sizes:?}");
        return fixed;
    }
    let needed = (sizes.rows as u32)
        .next_power_of_two()
        .clamp(UNIT_ROWS, MAX_BLOCK);
    let blocks = std::iter::successors(Some(needed), |&block| {
        (block > UNIT_ROWS).then_some(block / 2)
    });
    let reads = |tiling: &Tiling| 1.0 / tiling.block as f64 + 1.0 / tiling.tile as f64;
    blocks
        .flat_map(|block| TILES.map(|tile| tiling(block, tile)))
        .filter(fits)
        .min_by(|a, b| reads(a).total_cmp(&reads(b)).then(b.block.cmp(&a.block)))
        .unwrap_or_else(|| panic!("no tiling of width {width} fits {sizes:?}"))
}

/// Bytes of shared memory a cube of `tiling` takes in `pass` (`element`-byte inputs, loads of
/// `vector` elements): its rows of inputs (each padded by one vector), the weights it shares
/// between units, and its per-row scratch.
pub(crate) fn shared_memory(pass: Pass, tiling: &Tiling, element: usize, vector: usize) -> usize {
    let [block, tile, lanes] = [tiling.block, tiling.tile, tiling.lanes].map(|n| n as usize);
    let row = (tiling.width as usize / vector + 1) * vector * element;
    // A tile column of weights: one `f32` per row of the block.
    let weights = tile * block * 4;
    match pass {
        Pass::Forward => (block + 2 * tile) * row + tile * 4 + weights + block * lanes * 4,
        Pass::QueryGrad => (2 * block + 2 * tile) * row + tile * 4 + weights,
        Pass::KeyValueGrad => (2 * block + 2 * tile) * row + 2 * tile * 4 + 2 * weights,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sizes(head_dim: usize, rows: usize, shared_memory: usize) -> Sizes {
        Sizes {
            head_dim,
            element: 4,
            rows,
            vector: vector_size(head_dim, 4),
            shared_memory,
            max_units: 256,
        }
    }

    #[test]
    fn widths_are_padded_to_the_next_compiled_one() {
        assert_eq!(compiled_width(16), 64);
        assert_eq!(compiled_width(64), 64);
        assert_eq!(compiled_width(72), 80);
        assert_eq!(compiled_width(128), 128);
        assert_eq!(compiled_width(200), 256);
        assert_eq!(compiled_width(300), 320);
        assert_eq!(vector_size(64, 4), 4);
        assert_eq!(vector_size(50, 4), 2);
        assert_eq!(vector_size(63, 4), 1);
        assert_eq!(vector_size(64, 2), 2);
    }

    #[test]
    fn the_largest_block_and_tile_that_fit_are_chosen() {
        // 48 KiB (a Vulkan adapter on NVIDIA): width 64 takes 64 rows by 32 keys.
        let big = tiling(Pass::Forward, sizes(64, 1024, 48 << 10), TileRule::Auto);
        assert_eq!((big.block, big.tile, big.lanes), (64, 32, 8));
        // 32 KiB (lavapipe): smaller.
        let small = tiling(Pass::Forward, sizes(64, 1024, 32 << 10), TileRule::Auto);
        assert!(shared_memory(Pass::Forward, &small, 4, 4) <= 32 << 10);
        assert!(small.block * small.tile < 64 * 32);
        // A decoding step of one query and a group of 3 heads: one block of 4 rows.
        let step = tiling(Pass::Forward, sizes(64, 3, 48 << 10), TileRule::Auto);
        assert_eq!((step.block, step.tile), (4, 32));
        // Width 80 in vectors of 4: 20 vectors, 4 lanes.
        assert_eq!(
            tiling(Pass::Forward, sizes(80, 64, 48 << 10), TileRule::Auto).lanes,
            4
        );
        assert_eq!(
            tiling(Pass::KeyValueGrad, sizes(256, 64, 48 << 10), TileRule::Auto).lanes,
            16
        );
    }

    #[test]
    #[should_panic(expected = "does not fit")]
    fn a_fixed_tiling_too_large_for_the_device_is_refused() {
        tiling(
            Pass::Forward,
            sizes(128, 64, 16 << 10),
            TileRule::Fixed {
                block: 64,
                tile: 32,
            },
        );
    }
}
