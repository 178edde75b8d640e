//! The node <-> agent frame decoder on arbitrary bytes: it must never panic, never take
//! a frame over `MAX_FRAME`, consume exactly the frame its header announces, and every
//! frame it returns (but `Eof`, whose payload is ignored) must encode back to those bytes.
#![no_main]

use dsec_wire::frame::{Frame, MAX_FRAME};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // Fed in two pieces, as a socket would deliver it.
    let split = data.first().map_or(0, |b| *b as usize % (data.len() + 1));
    let mut buf = data[..split].to_vec();
    let mut rest = &data[split..];
    loop {
        let before = buf.clone();
        match Frame::decode(&mut buf) {
            Ok(Some(frame)) => {
                let used = before.len() - buf.len();
                let announced = u32::from_be_bytes([before[0], before[1], before[2], before[3]]);
                assert_eq!(used, 4 + announced as usize);
                assert!(used <= MAX_FRAME + 5);
                if frame != Frame::Eof {
                    assert_eq!(frame.to_bytes(), before[..used]);
                }
            }
            Ok(None) if rest.is_empty() => break,
            Ok(None) => {
                buf.extend_from_slice(rest);
                rest = &[];
            }
            // A malformed stream ends there.
            Err(_) => break,
        }
    }
    if data.len() >= 5 {
        let header = [data[0], data[1], data[2], data[3], data[4]];
        if let Ok((_, len)) = Frame::parse_header(header) {
            assert!(len <= MAX_FRAME);
        }
    }
});
