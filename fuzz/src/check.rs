// Shared by the importer targets (included, so each target stays one file for cargo fuzz).

/// Panics if the importer left anything in `work` besides `expected`, or put anything
/// into `outside` (a sibling of its destination).
#[allow(dead_code)]
pub fn nothing_escaped(work: &std::path::Path, expected: &[&str], outside: &std::path::Path) {
    let mut names: Vec<String> = std::fs::read_dir(work)
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    let mut want: Vec<String> = expected.iter().map(|s| s.to_string()).collect();
    want.sort();
    assert_eq!(names, want, "the importer wrote beside its destination");
    let inside = std::fs::read_dir(outside).map(|d| d.count()).unwrap_or(0);
    assert_eq!(inside, 0, "the importer wrote into a sibling directory");
}
