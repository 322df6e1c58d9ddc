//! Fuzzes what na-sm reads from an owner file in the socket directory
//! (`cleanup::read_owner`, `cleanup::parse_owner`): any process of our
//! uid may write one, and `cleanup_stale` judges its owner alive or dead
//! by it. Any bytes give a line or none, never a panic; only versions
//! 1..=`OWNER_VERSION` are taken; a line read is the one its own text
//! gives back, and every line we write (`OwnerLine`'s `Display`, which
//! the claim writes) is read back as written.
#![no_main]

use libfuzzer_sys::fuzz_target;
use na_sm::cleanup::{parse_owner, read_owner, OwnerLine, OWNER_VERSION};

fuzz_target!(|data: &[u8]| {
    // What the judgement reads: the first 256 bytes, as text.
    let read = read_owner(data);
    let head = &data[..data.len().min(256)];
    let text = std::str::from_utf8(head).ok();
    assert_eq!(
        read,
        text.and_then(parse_owner),
        "read_owner is parse_owner of the first 256 bytes"
    );
    if let Ok(t) = std::str::from_utf8(data) {
        if let Some(l) = parse_owner(t) {
            assert!((1..=OWNER_VERSION).contains(&l.version), "{l:?}");
            assert_eq!(t.split_ascii_whitespace().next(), Some("qs-sm-owner"));
            assert_eq!(parse_owner(&l.to_string()), Some(l), "{t:?}");
        }
    }
    // A line as the claim writes it, from the first 16 bytes.
    if let Some(w) = data.get(..16) {
        let line = OwnerLine {
            version: u32::from(w[0] % 4),
            pid: u32::from_le_bytes(w[1..5].try_into().expect("4")),
            start: u64::from_le_bytes(w[5..13].try_into().expect("8")),
        };
        let written = format!("{line}\n");
        let back = read_owner(written.as_bytes());
        if (1..=OWNER_VERSION).contains(&line.version) {
            assert_eq!(back, Some(line), "{written:?}");
        } else {
            assert_eq!(back, None, "version {} taken", line.version);
        }
    }
});
