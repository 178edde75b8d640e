//! Human-readable and JSON rendering helpers.

use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;

/// Prints a value as pretty JSON on stdout.
pub fn print_json<T: Serialize>(v: &T) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(v)?);
    Ok(())
}

/// A plain aligned table, like `docker ps`: columns separated by three spaces.
#[derive(Debug)]
pub struct Table {
    headers: Vec<&'static str>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// A table with these column headers.
    pub fn new(headers: &[&'static str]) -> Self {
        Self {
            headers: headers.to_vec(),
            rows: Vec::new(),
        }
    }

    /// Adds a row (one cell per header).
    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    /// Renders the table, one line per row plus the header line.
    pub fn render(&self) -> String {
        let mut widths: Vec<usize> = self.headers.iter().map(|h| h.chars().count()).collect();
        for row in &self.rows {
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(cell.chars().count());
            }
        }
        let header: Vec<String> = self.headers.iter().map(|h| (*h).to_owned()).collect();
        let mut out = String::new();
        for row in std::iter::once(&header).chain(&self.rows) {
            let last = row.len().saturating_sub(1);
            let mut line = String::new();
            for (i, cell) in row.iter().enumerate() {
                line.push_str(cell);
                if i < last {
                    let pad = widths.get(i).copied().unwrap_or(0) - cell.chars().count();
                    line.push_str(&" ".repeat(pad + 3));
                }
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }
}

/// Current time in unix milliseconds.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// A compact duration: `45s`, `12m`, `3h5m`, `2d4h`.
pub fn compact_duration(ms: u64) -> String {
    let s = ms / 1000;
    match s {
        0..=59 => format!("{s}s"),
        60..=3599 => format!("{}m", s / 60),
        3600..=86_399 => match (s % 3600) / 60 {
            0 => format!("{}h", s / 3600),
            m => format!("{}h{m}m", s / 3600),
        },
        _ => match (s % 86_400) / 3600 {
            0 => format!("{}d", s / 86_400),
            h => format!("{}d{h}h", s / 86_400),
        },
    }
}

/// How long ago a unix-ms time was: `5m ago`.
pub fn ago(t_ms: u64) -> String {
    format!("{} ago", compact_duration(now_ms().saturating_sub(t_ms)))
}

/// How far in the future a unix-ms time is: `in 55m`, or `now` when past.
pub fn until(t_ms: u64) -> String {
    let now = now_ms();
    if t_ms <= now {
        "now".to_owned()
    } else {
        format!("in {}", compact_duration(t_ms - now))
    }
}

/// A byte count with a binary unit: `512 B`, `1.5 MiB`.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit < UNITS.len() - 1 {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

/// `k=v,k2=v2`.
pub fn labels(map: &std::collections::BTreeMap<String, String>) -> String {
    map.iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_and_sizes() {
        assert_eq!(compact_duration(45_000), "45s");
        assert_eq!(compact_duration(12 * 60_000), "12m");
        assert_eq!(compact_duration(3_600_000), "1h");
        assert_eq!(compact_duration(3_900_000), "1h5m");
        assert_eq!(compact_duration(2 * 86_400_000 + 4 * 3_600_000), "2d4h");
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(1536 * 1024), "1.5 MiB");
    }

    #[test]
    fn table_aligns() {
        let mut t = Table::new(&["ID", "STATE"]);
        t.row(vec!["abc".into(), "ready".into()]);
        t.row(vec!["a".into(), String::new()]);
        assert_eq!(t.render(), "ID    STATE\nabc   ready\na\n");
    }
}
