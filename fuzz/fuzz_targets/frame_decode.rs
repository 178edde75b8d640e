//! The node <-> agent frame decoder on arbitrary bytes, and the JSON messages the frames
//! carry (a reply comes from the agent, which runs inside the sandbox and may be
//! hostile): decoding must never panic, never take a frame over `MAX_FRAME`, consume
//! exactly the frame its header announces, and every frame it returns (but `Eof`, whose
//! payload is ignored) must encode back to those bytes. A JSON frame that parses as a
//! request or a reply must survive a serialize/parse round trip unchanged.
#![no_main]

use dsec_wire::agent::{Reply, Request};
use dsec_wire::frame::{Frame, MAX_FRAME};
use libfuzzer_sys::fuzz_target;

fn round_trips<T>(payload: &[u8])
where
    T: serde::Serialize + serde::de::DeserializeOwned + PartialEq + std::fmt::Debug,
{
    if let Ok(v) = serde_json::from_slice::<T>(payload) {
        let again = serde_json::to_vec(&v).expect("a parsed message serializes");
        let back: T = serde_json::from_slice(&again).expect("a serialized message parses");
        assert_eq!(back, v);
    }
}

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
                if let Frame::Json(payload) = &frame {
                    round_trips::<Request>(payload);
                    round_trips::<Reply>(payload);
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
