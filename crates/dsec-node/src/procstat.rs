//! `/proc/PID/stat` of the processes the node watches (sandbox inits, claim holders).

/// The fields of `/proc/PID/stat` from field 3 (the state) on, so field `n` of proc(5) is
/// at index `n - 3`; `None` when the process is gone. The command name before them may
/// hold spaces and parentheses, so the split is after the last `)`.
pub(crate) fn fields(pid: i32) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = stat.get(stat.rfind(')')? + 1..)?;
    Some(rest.split_whitespace().map(str::to_owned).collect())
}

/// Index in [`fields`] of proc(5) field `n` (3 and up).
pub(crate) const fn at(n: usize) -> usize {
    n - 3
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_stat_parses() {
        let f = fields(std::process::id() as i32).expect("own stat");
        assert!(
            ["R", "S"].contains(&f[at(3)].as_str()),
            "state {}",
            f[at(3)]
        );
        assert_eq!(f[at(4)], std::os::unix::process::parent_id().to_string());
        assert!(fields(i32::MAX).is_none());
    }
}
