//! A full machine's screen and keyboard: screenshots (QMP `screendump`, as PNG) and
//! typed input (QMP `input-send-event` on the machine's PS/2 keyboard).
//!
//! The keyboard buffers a few bytes only (QEMU's PS/2 queue holds 16, about five key
//! strokes), and QEMU drops what does not fit; a key stroke is therefore sent on its own
//! and the next follows [`KEY_PACE`] later, about a fast typist's speed, which a guest
//! drains even when its virtual CPU waits its turn on a busy host.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use dsec_wire::v1::InputEvent;
use serde_json::{json, Value};

use crate::qemu::MachineFiles;
use crate::qmp::Qmp;
use crate::VmmError;

/// Most characters one `text` event may type.
pub const MAX_TEXT_CHARS: usize = 4096;
/// Most keys one chord may hold.
pub const MAX_CHORD_KEYS: usize = 8;
/// Most events one request may carry.
pub const MAX_EVENTS: usize = 256;
/// Time between key strokes.
pub const KEY_PACE: Duration = Duration::from_millis(15);
/// How long a QMP command may take.
const QMP_TIMEOUT: Duration = Duration::from_secs(10);
/// Screenshots taken by this process: each gets a file of its own.
static SCREENSHOTS: AtomicU64 = AtomicU64::new(0);

/// The screen of the machine in VM directory `dir`, as PNG.
pub fn screenshot(dir: &Path) -> Result<Vec<u8>, VmmError> {
    let files = MachineFiles::in_dir(dir);
    // QEMU writes the file; read and removed at once. Concurrent screenshots of one
    // machine each have their own.
    let n = SCREENSHOTS.fetch_add(1, Ordering::Relaxed);
    let out = dir.join(format!("screen-{}-{n}.png", std::process::id()));
    let mut qmp = Qmp::connect(&files.qmp, QMP_TIMEOUT)?;
    qmp.execute(
        "screendump",
        Some(json!({ "filename": out.display().to_string(), "format": "png" })),
    )?;
    let png = std::fs::read(&out);
    let _ = std::fs::remove_file(&out);
    Ok(png?)
}

/// Types `events` into the machine in VM directory `dir`, in order. QEMU's monitor
/// serves one client at a time, so each stroke has a session of its own: a screenshot
/// (or a pause) waits for one stroke, not for the whole text.
pub fn send_input(dir: &Path, events: &[InputEvent]) -> Result<(), VmmError> {
    let strokes = strokes(events)?;
    let files = MachineFiles::in_dir(dir);
    for (i, stroke) in strokes.iter().enumerate() {
        if i > 0 {
            std::thread::sleep(KEY_PACE);
        }
        let mut qmp = Qmp::connect(&files.qmp, QMP_TIMEOUT)?;
        let events: Vec<Value> = stroke
            .iter()
            .map(|(key, down)| {
                json!({ "type": "key", "data": { "down": down, "key": { "type": "qcode", "data": key } } })
            })
            .collect();
        qmp.execute("input-send-event", Some(json!({ "events": events })))?;
    }
    Ok(())
}

/// One key stroke: keys pressed (`true`) and released, in order, sent together.
pub type Stroke = Vec<(&'static str, bool)>;

/// The key strokes that type `events`, checked: at most [`MAX_EVENTS`] events, known
/// keys, printable ASCII text of at most [`MAX_TEXT_CHARS`], chords of at most
/// [`MAX_CHORD_KEYS`] keys.
pub fn strokes(events: &[InputEvent]) -> Result<Vec<Stroke>, VmmError> {
    let bad = |m: String| Err(VmmError::Input(m));
    if events.is_empty() {
        return bad("no input events".into());
    }
    if events.len() > MAX_EVENTS {
        return bad(format!(
            "{} input events; at most {MAX_EVENTS}",
            events.len()
        ));
    }
    let mut out = Vec::new();
    for event in events {
        match event {
            InputEvent::Text { text } => {
                if text.chars().count() > MAX_TEXT_CHARS {
                    return bad(format!("text of more than {MAX_TEXT_CHARS} characters"));
                }
                for c in text.chars() {
                    let Some((key, shift)) = char_key(c) else {
                        return bad(format!(
                            "cannot type {c:?}: text is printable ASCII, \\n and \\t"
                        ));
                    };
                    out.push(if shift {
                        vec![("shift", true), (key, true), (key, false), ("shift", false)]
                    } else {
                        vec![(key, true), (key, false)]
                    });
                }
            }
            InputEvent::Keys { keys } => {
                if keys.is_empty() || keys.len() > MAX_CHORD_KEYS {
                    return bad(format!("a chord holds 1 to {MAX_CHORD_KEYS} keys"));
                }
                let codes = keys
                    .iter()
                    .map(|k| {
                        key_code(k).ok_or_else(|| {
                            VmmError::Input(format!(
                                "unknown key {k:?} (QEMU key codes: a, 1, f1, ret, esc, ctrl, ...)"
                            ))
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                let mut stroke: Stroke = codes.iter().map(|k| (*k, true)).collect();
                stroke.extend(codes.iter().rev().map(|k| (*k, false)));
                out.push(stroke);
            }
        }
    }
    Ok(out)
}

/// QEMU's key code for a key name, aliases resolved.
fn key_code(name: &str) -> Option<&'static str> {
    let name = name.to_ascii_lowercase();
    let alias = match name.as_str() {
        "enter" | "return" => Some("ret"),
        "escape" => Some("esc"),
        "space" => Some("spc"),
        "control" | "ctrl_l" => Some("ctrl"),
        "super" | "meta" | "win" => Some("meta_l"),
        "alt_l" => Some("alt"),
        "shift_l" => Some("shift"),
        "pageup" => Some("pgup"),
        "pagedown" => Some("pgdn"),
        _ => None,
    };
    alias.or_else(|| KEY_CODES.iter().copied().find(|k| *k == name))
}

/// The key codes accepted by name (a subset of QEMU's `QKeyCode`: a full keyboard).
const KEY_CODES: &[&str] = &[
    "a",
    "b",
    "c",
    "d",
    "e",
    "f",
    "g",
    "h",
    "i",
    "j",
    "k",
    "l",
    "m",
    "n",
    "o",
    "p",
    "q",
    "r",
    "s",
    "t",
    "u",
    "v",
    "w",
    "x",
    "y",
    "z",
    "0",
    "1",
    "2",
    "3",
    "4",
    "5",
    "6",
    "7",
    "8",
    "9",
    "f1",
    "f2",
    "f3",
    "f4",
    "f5",
    "f6",
    "f7",
    "f8",
    "f9",
    "f10",
    "f11",
    "f12",
    "ret",
    "esc",
    "tab",
    "spc",
    "backspace",
    "delete",
    "insert",
    "up",
    "down",
    "left",
    "right",
    "home",
    "end",
    "pgup",
    "pgdn",
    "ctrl",
    "ctrl_r",
    "alt",
    "alt_r",
    "shift",
    "shift_r",
    "meta_l",
    "meta_r",
    "menu",
    "caps_lock",
    "num_lock",
    "scroll_lock",
    "print",
    "sysrq",
    "pause",
    "minus",
    "equal",
    "bracket_left",
    "bracket_right",
    "backslash",
    "semicolon",
    "apostrophe",
    "grave_accent",
    "comma",
    "dot",
    "slash",
    "kp_0",
    "kp_1",
    "kp_2",
    "kp_3",
    "kp_4",
    "kp_5",
    "kp_6",
    "kp_7",
    "kp_8",
    "kp_9",
    "kp_add",
    "kp_subtract",
    "kp_multiply",
    "kp_divide",
    "kp_enter",
    "kp_decimal",
];

/// The key that types `c` on a US layout, and whether it needs shift.
fn char_key(c: char) -> Option<(&'static str, bool)> {
    const DIGITS: [&str; 10] = ["0", "1", "2", "3", "4", "5", "6", "7", "8", "9"];
    if c.is_ascii_lowercase() {
        let i = (c as u8 - b'a') as usize;
        return Some((KEY_CODES[i], false));
    }
    if c.is_ascii_uppercase() {
        let i = (c as u8 - b'A') as usize;
        return Some((KEY_CODES[i], true));
    }
    if let Some(d) = c.to_digit(10) {
        return Some((DIGITS[d as usize], false));
    }
    Some(match c {
        ' ' => ("spc", false),
        '\n' => ("ret", false),
        '\t' => ("tab", false),
        '!' => ("1", true),
        '@' => ("2", true),
        '#' => ("3", true),
        '$' => ("4", true),
        '%' => ("5", true),
        '^' => ("6", true),
        '&' => ("7", true),
        '*' => ("8", true),
        '(' => ("9", true),
        ')' => ("0", true),
        '-' => ("minus", false),
        '_' => ("minus", true),
        '=' => ("equal", false),
        '+' => ("equal", true),
        '[' => ("bracket_left", false),
        '{' => ("bracket_left", true),
        ']' => ("bracket_right", false),
        '}' => ("bracket_right", true),
        '\\' => ("backslash", false),
        '|' => ("backslash", true),
        ';' => ("semicolon", false),
        ':' => ("semicolon", true),
        '\'' => ("apostrophe", false),
        '"' => ("apostrophe", true),
        '`' => ("grave_accent", false),
        '~' => ("grave_accent", true),
        ',' => ("comma", false),
        '<' => ("comma", true),
        '.' => ("dot", false),
        '>' => ("dot", true),
        '/' => ("slash", false),
        '?' => ("slash", true),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(t: &str) -> InputEvent {
        InputEvent::Text { text: t.into() }
    }

    #[test]
    fn text_is_typed_key_by_key_with_shift_where_needed() {
        let s = strokes(&[text("aB!\n")]).expect("strokes");
        assert_eq!(s.len(), 4);
        assert_eq!(s[0], vec![("a", true), ("a", false)]);
        assert_eq!(
            s[1],
            vec![("shift", true), ("b", true), ("b", false), ("shift", false)]
        );
        assert_eq!(s[2][1], ("1", true));
        assert_eq!(s[3], vec![("ret", true), ("ret", false)]);
        // Every printable ASCII character has its key.
        for c in (0x20u8..0x7f).map(char::from) {
            assert!(char_key(c).is_some(), "{c:?}");
        }
    }

    #[test]
    fn a_chord_is_pressed_in_order_and_released_in_reverse() {
        let s = strokes(&[InputEvent::Keys {
            keys: vec!["Control".into(), "alt".into(), "F2".into()],
        }])
        .expect("strokes");
        assert_eq!(
            s,
            vec![vec![
                ("ctrl", true),
                ("alt", true),
                ("f2", true),
                ("f2", false),
                ("alt", false),
                ("ctrl", false)
            ]]
        );
    }

    #[test]
    fn bad_input_is_refused_with_its_reason() {
        let refused = |events: &[InputEvent], what: &str| {
            let e = strokes(events).expect_err("refused").to_string();
            assert!(e.contains(what), "{e}");
        };
        refused(&[], "no input events");
        refused(&[text("é")], "cannot type 'é'");
        refused(&[text("\u{7}")], "cannot type");
        refused(&[text(&"a".repeat(MAX_TEXT_CHARS + 1))], "characters");
        refused(&[InputEvent::Keys { keys: vec![] }], "chord");
        refused(
            &[InputEvent::Keys {
                keys: vec!["ctrl".into(), "rm -rf".into()],
            }],
            "unknown key \"rm -rf\"",
        );
        refused(&vec![text("a"); MAX_EVENTS + 1], "input events");
    }
}
