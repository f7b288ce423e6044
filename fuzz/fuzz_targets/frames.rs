//! Frame decoding must never panic, loop or over-read, whatever a peer sends.
#![no_main]

use kspeed::transport::proto;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (accepted, _err) = proto::decode_stream(data);
    // Every accepted frame is at least a header.
    assert!(accepted * proto::HEADER_BYTES <= data.len());
    // A single header, decoded with a small DATA limit, must agree with
    // itself when re-encoded.
    if data.len() >= proto::HEADER_BYTES {
        let mut hb = [0u8; proto::HEADER_BYTES];
        hb.copy_from_slice(&data[..proto::HEADER_BYTES]);
        if let Ok(h) = proto::Header::decode(&hb, 1 << 16) {
            assert_eq!(h.encode(), hb);
        }
    }
});
