//! What the crate refuses at compile time, with the words it says it in: each
//! file of `tests/compile_fail/` is checked as a program of its own, which must
//! not compile, and whose errors must contain its `//~` lines and none of
//! its `//~!` lines, nor anything of [`NEVER_SAID`].

use std::path::Path;
use std::process::Command;

/// What no error may show, whatever it is about: the crate's own tables and
/// the private modules they live in, which a caller can do nothing about, and
/// the compiler's advice to raise the recursion limit, the sign of a bound it
/// lost itself in instead of naming what is wrong.
const NEVER_SAID: &[&str] = &[
    "diesel_claim_leases",
    "diesel_claim_schema_migrations",
    "diesel_claim::backend::",
    "overflow evaluating",
    "recursion_limit",
];

#[test]
fn refusals_at_compile_time_say_what_to_do() {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let project = Path::new(env!("CARGO_TARGET_TMPDIR")).join("compile-fail");
    let cases = crate_dir.join("tests/compile_fail");
    // Programs of earlier runs may have been renamed or removed since.
    let _ = std::fs::remove_dir_all(project.join("src/bin"));
    std::fs::create_dir_all(project.join("src/bin")).unwrap();
    std::fs::write(
        project.join("Cargo.toml"),
        format!(
            r#"[package]
name = "compile-fail"
version = "0.0.0"
edition = "2021"
publish = false

[dependencies]
diesel = {{ version = "2.3", default-features = false, features = ["postgres", "sqlite"] }}
diesel-async = {{ version = "0.9.2", features = ["postgres", "sqlite"] }}
diesel-claim = {{ path = {crate_dir:?}, features = ["postgres", "sqlite", "async"] }}

[workspace]
"#
        ),
    )
    .unwrap();
    // The crate's own lock file: the same versions, nothing to fetch.
    std::fs::copy(crate_dir.join("Cargo.lock"), project.join("Cargo.lock")).unwrap();

    let mut failures = Vec::new();
    let mut entries: Vec<_> = std::fs::read_dir(&cases)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .collect();
    entries.sort();
    for case in entries {
        let name = case.file_stem().unwrap().to_str().unwrap().to_owned();
        let source = std::fs::read_to_string(&case).unwrap();
        if !source.lines().any(|line| line.starts_with("//~ ")) {
            failures.push(format!(
                "{name}: names no words its errors must say (`//~ ` lines)"
            ));
        }
        std::fs::write(project.join("src/bin").join(format!("{name}.rs")), &source).unwrap();
        let output = Command::new(env!("CARGO"))
            .args(["check", "--offline", "--quiet", "--bin", &name])
            .current_dir(&project)
            .env("CARGO_TARGET_DIR", project.join("target"))
            .output()
            .unwrap();
        let errors = String::from_utf8_lossy(&output.stderr);
        if output.status.success() {
            failures.push(format!("{name}: compiled, but must not"));
            continue;
        }
        for expected in source.lines().filter_map(|line| line.strip_prefix("//~ ")) {
            if !errors.contains(expected) {
                failures.push(format!("{name}: the errors lack {expected:?}:\n{errors}"));
            }
        }
        let unwanted = source.lines().filter_map(|line| line.strip_prefix("//~! "));
        for unwanted in unwanted.chain(NEVER_SAID.iter().copied()) {
            if errors.contains(unwanted) {
                failures.push(format!("{name}: the errors say {unwanted:?}:\n{errors}"));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}
