//! The forward pass's work list over a ragged step: which cube computes which block of which
//! sequence's (query, query head) pairs over which split of its keys. Built on the host, once
//! per step and launch size, so that the grid holds exactly the cubes the step's sequences need
//! (a grid of every sequence × the longest's blocks would leave the shorter ones' cubes idle),
//! the heaviest first, so that the long ones do not start last.

use super::simt::WORK_COLUMNS;
use crate::paged::SequenceStep;

/// How a ragged step's forward launch is cut.
#[derive(Debug, Clone, Copy)]
pub(crate) struct WorkSizes {
    /// Query heads per key/value head: each query is that many pairs.
    pub group: usize,
    /// Pairs per block, the launch's tiling's.
    pub block: usize,
    /// Keys a query sees at most, its own included.
    pub window: Option<usize>,
}

/// One cube's share of the step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WorkItem {
    pub sequence: usize,
    pub block: usize,
    pub split: usize,
    pub splits: usize,
}

/// Every (sequence, block, split) of the step once, the cubes that read the most keys first.
/// `splits[s]` is sequence `s`'s count of key splits (1: none).
pub(crate) fn work_list(
    sequences: &[SequenceStep],
    splits: &[usize],
    sizes: WorkSizes,
) -> Vec<WorkItem> {
    let mut items: Vec<(usize, WorkItem)> = sequences
        .iter()
        .zip(splits)
        .enumerate()
        .flat_map(|(sequence, (step, &splits))| {
            let blocks = (step.new * sizes.group).div_ceil(sizes.block);
            (0..blocks).flat_map(move |block| {
                (0..splits).map(move |split| WorkItem {
                    sequence,
                    block,
                    split,
                    splits,
                })
            })
        })
        .map(|item| (keys_read(&sequences[item.sequence], &item, sizes), item))
        .collect();
    // Stable: equal cubes keep the order of their sequences and blocks.
    items.sort_by_key(|&(keys, _)| std::cmp::Reverse(keys));
    items.into_iter().map(|(_, item)| item).collect()
}

/// The keys `item`'s cube reads, as the kernel bounds them: from its first query's window to its
/// last query's position, within its split.
fn keys_read(step: &SequenceStep, item: &WorkItem, sizes: WorkSizes) -> usize {
    let pairs = step.new * sizes.group;
    let first_pair = item.block * sizes.block;
    let last_pair = (first_pair + sizes.block).min(pairs) - 1;
    let first_position = step.past + first_pair / sizes.group;
    let end = step.past + last_pair / sizes.group + 1;
    let start = sizes
        .window
        .map_or(0, |window| (first_position + 1).saturating_sub(window));
    let split_len = step.keys().div_ceil(item.splits);
    let (split_start, split_end) = (item.split * split_len, (item.split + 1) * split_len);
    end.min(split_end).saturating_sub(start.max(split_start))
}

/// The work list as the kernel reads it: `[cubes, WORK_COLUMNS]`, row-major, in the columns'
/// order.
pub(crate) fn rows(items: &[WorkItem]) -> (Vec<usize>, [usize; 2]) {
    let rows = items
        .iter()
        .flat_map(|item| [item.sequence, item.block, item.split, item.splits])
        .collect();
    (rows, [items.len(), WORK_COLUMNS as usize])
}

#[cfg(test)]
mod tests {
    use super::{WorkItem, WorkSizes, keys_read, work_list};
    use crate::paged::SequenceStep;

    const SIZES: WorkSizes = WorkSizes {
        group: 2,
        block: 8,
        window: None,
    };

    #[test]
    fn each_sequence_gets_its_own_blocks_and_splits_once() {
        // A prompt chunk of 20 queries (40 pairs: 5 blocks), a decoding row split in 3, and a
        // decoding row unsplit.
        let sequences = [
            SequenceStep { past: 10, new: 20 },
            SequenceStep { past: 400, new: 1 },
            SequenceStep { past: 5, new: 1 },
        ];
        let items = work_list(&sequences, &[1, 3, 1], SIZES);
        assert_eq!(items.len(), 5 + 3 + 1);
        let mut sorted = items.clone();
        sorted.sort_by_key(|item| (item.sequence, item.block, item.split));
        let expected: Vec<WorkItem> = (0..5)
            .map(|block| (0, block, 0, 1))
            .chain((0..3).map(|split| (1, 0, split, 3)))
            .chain([(2, 0, 0, 1)])
            .map(|(sequence, block, split, splits)| WorkItem {
                sequence,
                block,
                split,
                splits,
            })
            .collect();
        assert_eq!(sorted, expected);
    }

    #[test]
    fn the_cubes_that_read_the_most_keys_come_first() {
        let sequences = [
            SequenceStep { past: 0, new: 20 },
            SequenceStep { past: 400, new: 1 },
        ];
        let items = work_list(&sequences, &[1, 3], SIZES);
        let keys: Vec<usize> = items
            .iter()
            .map(|item| keys_read(&sequences[item.sequence], item, SIZES))
            .collect();
        // The decoding row's thirds (134, 134, 133), then the chunk's blocks, last first.
        assert_eq!(keys, [134, 134, 133, 20, 16, 12, 8, 4]);
        assert_eq!(items[3].block, 4);
    }

    #[test]
    fn a_window_bounds_the_keys_a_cube_reads() {
        let windowed = WorkSizes {
            window: Some(16),
            ..SIZES
        };
        let step = SequenceStep { past: 100, new: 8 };
        let item = WorkItem {
            sequence: 0,
            block: 1,
            split: 0,
            splits: 1,
        };
        // Queries 104 .. 107: keys from 104 + 1 − 16 = 89 up to 108.
        assert_eq!(keys_read(&step, &item, windowed), 108 - 89);
        assert_eq!(keys_read(&step, &item, SIZES), 108);
    }
}
