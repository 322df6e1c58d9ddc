//! Fuzzes what an na-sm connector or listener says in the handshake:
//! the hello (`decode_hello`, `hello_version`, the name in it), the
//! acknowledgement and a refusal's reason, the judgement of what came
//! with a hello (bytes, descriptors kept, refused, dropped), and the
//! peer's `/proc/<pid>/stat` line (its command name is its own choice).
//! Any bytes give a value or an error, never a panic; what decodes
//! encodes back to its bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use na_sm::conn::{
    check_ack, check_hello_parts, decode_hello, encode_ack, encode_hello, hello_version, refusal_reason,
    HelloParts, MAX_HELLO, MAX_REFUSAL, PROTO_VERSION,
};
use na_sm::sys::proc::{parse_innermost_pid, parse_start_time};
use na_sm::SmName;

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = decode_hello(data) {
        assert_eq!(encode_hello(&h.name), data, "decode then encode must round-trip");
        assert!(data.len() <= MAX_HELLO, "a hello longer than the receive buffer");
        assert_eq!(hello_version(data), Some(PROTO_VERSION));
        let name = SmName::parse_key(&h.name).expect("a decoded hello's name parses");
        assert_eq!(name.key(), h.name);
    }
    if let Ok(s) = std::str::from_utf8(data) {
        if let Ok(n) = SmName::parse(s) {
            assert_eq!(n.uri(), s, "parse then format must round-trip");
        }
        let _ = parse_innermost_pid(s);
    }
    assert_eq!(
        check_ack(data).is_ok(),
        data == encode_ack(),
        "only our acknowledgement is one"
    );
    if let Some(r) = refusal_reason(data) {
        // Bounded, and no control character reaches our logs.
        assert!(
            r.chars().count() <= MAX_REFUSAL && !r.chars().any(char::is_control),
            "{r:?}"
        );
    }
    let _ = parse_start_time(data);
    // The descriptors' judgement: complete only with bytes and exactly two
    // descriptors, none refused or dropped; silence is a departure.
    if let [a, b, c, d, ..] = *data {
        let (len, fds, refused, truncated) =
            (usize::from(a), usize::from(b & 7), usize::from(c & 3), d & 1 == 1);
        let v = check_hello_parts(len, fds, refused, truncated);
        assert_eq!(
            v == HelloParts::Complete,
            len > 0 && fds == 2 && refused == 0 && !truncated
        );
        assert_eq!(
            v == HelloParts::Departed,
            len == 0 && fds == 0 && refused == 0 && !truncated
        );
        assert!(!matches!(v, HelloParts::Dropped(_)) || (truncated && fds < 2 && refused == 0));
    }
});
