//! A full machine's screen, keyboard and pointer: screenshots (QMP `screendump`, as PNG),
//! typed input (QMP `input-send-event` on the machine's PS/2 keyboard) and pointer input
//! (the same command on its virtio tablet, which takes absolute positions).
//!
//! The keyboard buffers a few bytes only (QEMU's PS/2 queue holds 16, about five key
//! strokes), and QEMU drops what does not fit; a key stroke is therefore sent on its own
//! and the next follows [`KEY_PACE`] later, about a fast typist's speed, which a guest
//! drains even when its virtual CPU waits its turn on a busy host. Pointer steps are
//! paced the same way, well inside any double-click interval.

use std::io::Read;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use dsec_wire::v1::{InputEvent, MouseButton};
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
/// Most steps (key strokes, moves, button changes) one request may take: about a
/// minute at [`KEY_PACE`].
pub const MAX_STEPS: usize = 4096;
/// Most wheel notches one `scroll` event may turn, either way.
pub const MAX_SCROLL: u32 = 100;
/// Most clicks in a row one `click` event may make.
pub const MAX_CLICKS: u8 = 3;
/// Time between key strokes.
pub const KEY_PACE: Duration = Duration::from_millis(15);
/// How long a QMP command may take.
const QMP_TIMEOUT: Duration = Duration::from_secs(10);
/// The largest absolute pointer position QEMU's input layer takes, on either axis.
const ABS_MAX: u64 = 0x7fff;
/// Screenshots taken by this process: each gets a file of its own.
static SCREENSHOTS: AtomicU64 = AtomicU64::new(0);

/// The screen of the machine in VM directory `dir`, as PNG.
pub fn screenshot(dir: &Path) -> Result<Vec<u8>, VmmError> {
    dump(dir, "png", |f| {
        let mut png = Vec::new();
        f.read_to_end(&mut png)?;
        Ok(png)
    })
}

/// The screen's size in pixels, (width, height): the header of an uncompressed dump.
pub fn screen_size(dir: &Path) -> Result<(u32, u32), VmmError> {
    let header = dump(dir, "ppm", |f| {
        let mut head = Vec::new();
        f.take(64).read_to_end(&mut head)?;
        Ok(head)
    })?;
    parse_ppm_size(&header)
        .ok_or_else(|| VmmError::Setup("QEMU's screen dump has no PPM header".into()))
}

/// Has QEMU dump the screen to a file of its own (concurrent dumps of one machine never
/// share one), reads it with `read` and removes it.
fn dump<T>(
    dir: &Path,
    format: &str,
    read: impl FnOnce(&mut std::fs::File) -> std::io::Result<T>,
) -> Result<T, VmmError> {
    let files = MachineFiles::in_dir(dir);
    let n = SCREENSHOTS.fetch_add(1, Ordering::Relaxed);
    let out = dir.join(format!("screen-{}-{n}.{format}", std::process::id()));
    let mut qmp = Qmp::connect(&files.qmp, QMP_TIMEOUT)?;
    let done = qmp.execute(
        "screendump",
        Some(json!({ "filename": out.display().to_string(), "format": format })),
    );
    let read = done.map(|_| std::fs::File::open(&out).and_then(|mut f| read(&mut f)));
    let _ = std::fs::remove_file(&out);
    Ok(read??)
}

/// Width and height from a binary PPM header (`P6 <w> <h> <max>`).
fn parse_ppm_size(head: &[u8]) -> Option<(u32, u32)> {
    let text = String::from_utf8_lossy(head);
    let mut fields = text.split_ascii_whitespace();
    if fields.next()? != "P6" {
        return None;
    }
    Some((fields.next()?.parse().ok()?, fields.next()?.parse().ok()?))
}

/// Sends `events` to the machine in VM directory `dir`, in order. QEMU's monitor serves
/// one client at a time, so each step has a session of its own: a screenshot (or a
/// pause) waits for one step, not for the whole text.
pub fn send_input(dir: &Path, events: &[InputEvent]) -> Result<(), VmmError> {
    let steps = steps(events)?;
    // Pixels become the tablet's absolute positions against the screen's size now.
    let size = if steps.iter().any(|s| matches!(s, Step::MoveTo { .. })) {
        Some(screen_size(dir)?)
    } else {
        None
    };
    let files = MachineFiles::in_dir(dir);
    let mut sent = Vec::with_capacity(steps.len());
    for step in &steps {
        sent.push(qmp_events(step, size)?);
    }
    for (i, events) in sent.into_iter().enumerate() {
        if i > 0 {
            std::thread::sleep(KEY_PACE);
        }
        let mut qmp = Qmp::connect(&files.qmp, QMP_TIMEOUT)?;
        qmp.execute("input-send-event", Some(json!({ "events": events })))?;
    }
    Ok(())
}

/// One step of input, sent to the machine in one QMP command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Keys pressed (`true`) and released, in order: one stroke or chord.
    Keys(Vec<(&'static str, bool)>),
    /// The pointer moves to pixel (`x`, `y`).
    MoveTo {
        /// Column.
        x: u32,
        /// Row.
        y: u32,
    },
    /// A button (QEMU's name: `left`, `wheel-down`, ...) goes down or up.
    Button {
        /// QEMU's name of the button.
        button: &'static str,
        /// Pressed or released.
        down: bool,
    },
}

/// QEMU's input events for `step`; a move is checked against the screen's `size`.
fn qmp_events(step: &Step, size: Option<(u32, u32)>) -> Result<Vec<Value>, VmmError> {
    Ok(match step {
        Step::Keys(keys) => keys
            .iter()
            .map(|(key, down)| {
                json!({ "type": "key", "data": { "down": down, "key": { "type": "qcode", "data": key } } })
            })
            .collect(),
        Step::Button { button, down } => {
            vec![json!({ "type": "btn", "data": { "down": down, "button": button } })]
        }
        Step::MoveTo { x, y } => {
            let (w, h) = size.ok_or_else(|| VmmError::Setup("no screen size".into()))?;
            if *x >= w || *y >= h {
                return Err(VmmError::Input(format!(
                    "({x}, {y}) is off the {w}x{h} screen"
                )));
            }
            vec![
                json!({ "type": "abs", "data": { "axis": "x", "value": abs_position(*x, w) } }),
                json!({ "type": "abs", "data": { "axis": "y", "value": abs_position(*y, h) } }),
            ]
        }
    })
}

/// The tablet's absolute position of pixel `p` on an axis `size` pixels long: the
/// smallest that a guest scaling back (`abs * (size - 1) / ABS_MAX`, rounded down) reads
/// as `p` again.
fn abs_position(p: u32, size: u32) -> u64 {
    let span = u64::from(size.max(2) - 1);
    (u64::from(p) * ABS_MAX).div_ceil(span).min(ABS_MAX)
}

/// The steps that carry out `events`, checked: at most [`MAX_EVENTS`] events, known
/// keys, printable ASCII text of at most [`MAX_TEXT_CHARS`], chords of at most
/// [`MAX_CHORD_KEYS`] keys, clicks and scrolls within their bounds.
pub fn steps(events: &[InputEvent]) -> Result<Vec<Step>, VmmError> {
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
                    out.push(Step::Keys(if shift {
                        vec![("shift", true), (key, true), (key, false), ("shift", false)]
                    } else {
                        vec![(key, true), (key, false)]
                    }));
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
                let mut stroke: Vec<_> = codes.iter().map(|k| (*k, true)).collect();
                stroke.extend(codes.iter().rev().map(|k| (*k, false)));
                out.push(Step::Keys(stroke));
            }
            InputEvent::Move { x, y } => out.push(Step::MoveTo { x: *x, y: *y }),
            InputEvent::Click {
                button,
                x,
                y,
                count,
            } => {
                match (x, y) {
                    (Some(x), Some(y)) => out.push(Step::MoveTo { x: *x, y: *y }),
                    (None, None) => {}
                    _ => return bad("a click gives both x and y, or neither".into()),
                }
                let count = count.unwrap_or(1);
                if !(1..=MAX_CLICKS).contains(&count) {
                    return bad(format!("a click counts 1 to {MAX_CLICKS}"));
                }
                for _ in 0..count {
                    for down in [true, false] {
                        out.push(Step::Button {
                            button: button_name(*button),
                            down,
                        });
                    }
                }
            }
            InputEvent::Button { button, down } => out.push(Step::Button {
                button: button_name(*button),
                down: *down,
            }),
            InputEvent::Scroll { dy } => {
                if *dy == 0 || dy.unsigned_abs() > MAX_SCROLL {
                    return bad(format!(
                        "a scroll turns 1 to {MAX_SCROLL} notches either way"
                    ));
                }
                let wheel = if *dy > 0 { "wheel-down" } else { "wheel-up" };
                for _ in 0..dy.unsigned_abs() {
                    for down in [true, false] {
                        out.push(Step::Button {
                            button: wheel,
                            down,
                        });
                    }
                }
            }
        }
        if out.len() > MAX_STEPS {
            return bad(format!(
                "input of more than {MAX_STEPS} key strokes and pointer steps"
            ));
        }
    }
    Ok(out)
}

/// QEMU's name of a mouse button.
fn button_name(b: MouseButton) -> &'static str {
    match b {
        MouseButton::Left => "left",
        MouseButton::Right => "right",
        MouseButton::Middle => "middle",
    }
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

    fn keys(step: &Step) -> &[(&'static str, bool)] {
        match step {
            Step::Keys(k) => k,
            other => panic!("not keys: {other:?}"),
        }
    }

    #[test]
    fn text_is_typed_key_by_key_with_shift_where_needed() {
        let s = steps(&[text("aB!\n")]).expect("steps");
        assert_eq!(s.len(), 4);
        assert_eq!(keys(&s[0]), [("a", true), ("a", false)]);
        assert_eq!(
            keys(&s[1]),
            [("shift", true), ("b", true), ("b", false), ("shift", false)]
        );
        assert_eq!(keys(&s[2])[1], ("1", true));
        assert_eq!(keys(&s[3]), [("ret", true), ("ret", false)]);
        // Every printable ASCII character has its key.
        for c in (0x20u8..0x7f).map(char::from) {
            assert!(char_key(c).is_some(), "{c:?}");
        }
    }

    #[test]
    fn a_chord_is_pressed_in_order_and_released_in_reverse() {
        let s = steps(&[InputEvent::Keys {
            keys: vec!["Control".into(), "alt".into(), "F2".into()],
        }])
        .expect("steps");
        assert_eq!(
            s,
            vec![Step::Keys(vec![
                ("ctrl", true),
                ("alt", true),
                ("f2", true),
                ("f2", false),
                ("alt", false),
                ("ctrl", false)
            ])]
        );
    }

    #[test]
    fn a_click_moves_first_and_a_scroll_turns_the_wheel() {
        let s = steps(&[
            InputEvent::Click {
                button: MouseButton::Right,
                x: Some(10),
                y: Some(20),
                count: Some(2),
            },
            InputEvent::Scroll { dy: -2 },
        ])
        .expect("steps");
        let right = |down| Step::Button {
            button: "right",
            down,
        };
        let up = |down| Step::Button {
            button: "wheel-up",
            down,
        };
        assert_eq!(
            s,
            vec![
                Step::MoveTo { x: 10, y: 20 },
                right(true),
                right(false),
                right(true),
                right(false),
                up(true),
                up(false),
                up(true),
                up(false)
            ]
        );
        // A click where the pointer is, left by default (as the wire reads it).
        let e: InputEvent = serde_json::from_str(r#"{"type":"click"}"#).expect("json");
        assert_eq!(
            steps(&[e]).expect("steps"),
            vec![
                Step::Button {
                    button: "left",
                    down: true
                },
                Step::Button {
                    button: "left",
                    down: false
                }
            ]
        );
    }

    #[test]
    fn pixels_become_absolute_positions_a_guest_reads_back_exactly() {
        for size in [400u32, 720, 768, 1024, 1080, 4096] {
            for p in [0, 1, size / 3, size / 2, size - 2, size - 1] {
                let abs = abs_position(p, size);
                assert!(abs <= ABS_MAX);
                assert_eq!(
                    abs * u64::from(size - 1) / ABS_MAX,
                    u64::from(p),
                    "{p} of {size}"
                );
            }
        }
        assert_eq!(abs_position(0, 720), 0);
        assert_eq!(abs_position(719, 720), ABS_MAX);
        let off = qmp_events(&Step::MoveTo { x: 720, y: 0 }, Some((720, 400)));
        assert!(off
            .expect_err("off screen")
            .to_string()
            .contains("off the 720x400 screen"));
        assert_eq!(
            parse_ppm_size(b"P6\n720 400\n255\n\x00\xff"),
            Some((720, 400))
        );
        assert_eq!(parse_ppm_size(b"P5\n720 400\n255\n"), None);
    }

    #[test]
    fn bad_input_is_refused_with_its_reason() {
        let refused = |events: &[InputEvent], what: &str| {
            let e = steps(events).expect_err("refused").to_string();
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
        // Each event within its bounds, but a request that would type for minutes.
        refused(&vec![text(&"a".repeat(MAX_TEXT_CHARS)); 2], "key strokes");
        refused(&[InputEvent::Scroll { dy: 0 }], "notches");
        refused(&[InputEvent::Scroll { dy: i32::MIN }], "notches");
        let click = |x, y, count| InputEvent::Click {
            button: MouseButton::Left,
            x,
            y,
            count,
        };
        refused(&[click(Some(1), None, None)], "both x and y");
        refused(&[click(None, None, Some(0))], "counts 1 to 3");
        refused(&[click(None, None, Some(9))], "counts 1 to 3");
    }
}
