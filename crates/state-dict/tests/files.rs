//! A state dict's files: what reading one that is absent, malformed or of no known format
//! reports.

use state_dict::{FileError, StateDict, StateDictError};

#[test]
fn a_file_that_is_absent_malformed_or_of_no_known_format_is_a_file_error() {
    let dir = std::env::temp_dir().join(format!("state-dict-errors-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let e = StateDict::load(dir.join("absent.safetensors")).unwrap_err();
    assert!(
        matches!(e, StateDictError::File(FileError::Io { .. }))
            && e.to_string().contains("No such file"),
        "{e}"
    );
    let garbage = dir.join("garbage.safetensors");
    std::fs::write(&garbage, b"not a safetensors file").unwrap();
    let e = StateDict::load(&garbage).unwrap_err();
    assert!(
        matches!(e, StateDictError::File(FileError::Malformed { .. })),
        "{e}"
    );
    let garbage_pt = dir.join("garbage.pt");
    std::fs::write(&garbage_pt, b"not a zip").unwrap();
    let e = StateDict::load(&garbage_pt).unwrap_err();
    assert!(
        matches!(e, StateDictError::File(FileError::Malformed { .. })),
        "{e}"
    );
    let txt = dir.join("weights.txt");
    std::fs::write(&txt, b"").unwrap();
    assert!(matches!(
        StateDict::load(&txt),
        Err(StateDictError::File(FileError::UnknownFormat { .. }))
    ));
    std::fs::remove_dir_all(&dir).unwrap();
}
