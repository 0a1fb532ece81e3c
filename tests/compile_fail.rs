//! What the crate refuses at compile time, with the words it says it in: each
//! file of `tests/compile_fail/` is checked as a program of its own, which must
//! not compile, and whose errors must contain its `//~` lines and none of
//! its `//~!` lines, nor anything of [`NEVER_SAID`], nor a type or trait by a
//! path through the crate's private modules ([`private_paths`]); and come to
//! as many errors, in at most as many lines, as its `//~#` line says
//! (`//~# 1 error in at most 30 lines`), so that a refusal does not grow
//! unnoticed.

use std::path::{Path, PathBuf};
use std::process::Command;

/// What no error may show, whatever it is about: the crate's own tables,
/// which a caller can do nothing about, and the compiler's advice to raise
/// the recursion limit, the sign of a bound it lost itself in instead of
/// naming what is wrong.
const NEVER_SAID: &[&str] = &[
    "diesel_claim_leases",
    "diesel_claim_schema_migrations",
    "overflow evaluating",
    "recursion_limit",
];

/// The crate's public modules: a type or trait an error names must be
/// reached through these alone (`diesel_claim::bounds::StampType`), so that
/// the reader finds its documentation.
const PUBLIC_MODULES: &[&str] = &[
    "advisory",
    "aio",
    "bounds",
    "guide",
    "kind",
    "metrics",
    "migrations",
    "named_lock",
    "prelude",
];

/// The crate's types and traits that `errors` names by a path through a
/// private module (`diesel_claim::claim::query::ClaimStatements`). A path
/// without a type, such as the function a bound belongs to
/// (`diesel_claim::claim::run::<impl ClaimBuilder<…>>::each`), only says
/// where, and is let be.
fn private_paths(errors: &str) -> Vec<&str> {
    errors
        .match_indices("diesel_claim::")
        .map(|(at, _)| {
            let rest = &errors[at..];
            let end = rest
                .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
                .unwrap_or(rest.len());
            &rest[..end]
        })
        .filter(|path| {
            let segments: Vec<&str> = path.split("::").skip(1).collect();
            match segments
                .iter()
                .position(|segment| segment.starts_with(char::is_uppercase))
            {
                Some(named) => !segments[..named]
                    .iter()
                    .all(|module| PUBLIC_MODULES.contains(module)),
                None => false,
            }
        })
        .collect()
}

/// The programs of `tests/compile_fail/`, by name.
fn cases() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/compile_fail");
    let mut cases: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .collect();
    cases.sort();
    cases
}

/// How many errors a program's refusal comes to, and in at most how many
/// lines: its `//~# N errors in at most M lines` line.
fn expected_size(source: &str) -> Option<(usize, usize)> {
    let line = source.lines().find_map(|line| line.strip_prefix("//~# "))?;
    let numbers: Vec<usize> = line
        .split(' ')
        .filter_map(|word| word.parse().ok())
        .collect();
    match numbers[..] {
        [errors, lines] => Some((errors, lines)),
        _ => None,
    }
}

/// How many errors `output` reports (the compiler's closing "could not
/// compile" line is not one), and in how many lines.
fn size_of(output: &str) -> (usize, usize) {
    let errors = output
        .lines()
        .filter(|line| line.starts_with("error") && !line.starts_with("error: could not compile"))
        .count();
    (errors, output.lines().count())
}

/// What a program's errors must say: its `//~ ` lines.
fn expected_words(source: &str) -> impl Iterator<Item = &str> {
    source.lines().filter_map(|line| line.strip_prefix("//~ "))
}

#[test]
fn refusals_at_compile_time_say_what_to_do() {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let project = Path::new(env!("CARGO_TARGET_TMPDIR")).join("compile-fail");
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
# The pools' features, without diesel-claim's: for the refusals that name them.
diesel-async = {{ version = "0.9.2", features = ["postgres", "sqlite", "bb8", "deadpool"] }}
diesel-claim = {{ path = {crate_dir:?}, features = ["postgres", "sqlite", "async", "migrations"] }}

[workspace]
"#
        ),
    )
    .unwrap();
    // The crate's own lock file: the same versions, nothing to fetch.
    std::fs::copy(crate_dir.join("Cargo.lock"), project.join("Cargo.lock")).unwrap();

    let mut failures = Vec::new();
    for case in cases() {
        let name = case.file_stem().unwrap().to_str().unwrap().to_owned();
        let source = std::fs::read_to_string(&case).unwrap();
        if expected_words(&source).next().is_none() {
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
        match expected_size(&source) {
            None => failures.push(format!(
                "{name}: says not how long its refusal is (`//~# N errors in at most M lines`)"
            )),
            Some((count, most)) => {
                let (said, lines) = size_of(&errors);
                if said != count || lines > most {
                    failures.push(format!(
                        "{name}: {said} errors in {lines} lines, where {count} in at most \
                         {most} are expected:\n{errors}"
                    ));
                }
            }
        }
        for expected in expected_words(&source) {
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
        let mut private = private_paths(&errors);
        private.sort_unstable();
        private.dedup();
        if !private.is_empty() {
            failures.push(format!(
                "{name}: the errors name {private:?}, private to the crate:\n{errors}"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn private_paths_are_types_reached_through_private_modules() {
    let errors = "the trait `diesel_claim::claim::query::ClaimStatements<Pg, Order>` is not \
                  implemented; `diesel_claim::bounds::StampType<Pg>`, \
                  `diesel_claim::aio::prelude::ClaimDsl`, required by a bound in \
                  `diesel_claim::claim::run::<impl ClaimBuilder<Q>>::each`, \
                  `diesel_claim::sql::order::KeyOrder`, `diesel_claim::rebuild(|| …)`";
    assert_eq!(
        private_paths(errors),
        [
            "diesel_claim::claim::query::ClaimStatements",
            "diesel_claim::sql::order::KeyOrder"
        ]
    );
}

/// The `message`s of the crate's `#[diagnostic::on_unimplemented]`s, each
/// cut into the words around its placeholders (`rows of type`, `cannot be
/// claimed from`): for `every_message_of_the_crate_is_checked`.
fn messages_in(source: &str) -> Vec<Vec<String>> {
    let mut messages = Vec::new();
    let mut rest = source;
    while let Some(at) = rest.find("#[diagnostic::on_unimplemented(") {
        rest = &rest[at..];
        let start = rest.find("message = \"").expect("a message") + "message = \"".len();
        let end = start + rest[start..].find("\",").expect("the message's end");
        // A string literal's `\` at a line's end joins it to the next
        // line's text, without the indentation.
        let text = rest[start..end]
            .split("\\\n")
            .map(str::trim_start)
            .collect::<String>();
        let words = text
            .split(['{', '}'])
            .step_by(2)
            .map(|words| words.trim_matches(['`', ' ']))
            .filter(|words| words.len() > 3)
            .map(str::to_owned)
            .collect();
        messages.push(words);
        rest = &rest[end..];
    }
    messages
}

/// Every message the crate gives through `on_unimplemented` is one some
/// program of `tests/compile_fail/` expects, all its words in the same
/// program: a message that no program can make the compiler show is told
/// nowhere.
#[test]
fn every_message_of_the_crate_is_checked() {
    let expected: Vec<String> = cases()
        .iter()
        .map(|case| {
            let source = std::fs::read_to_string(case).unwrap();
            expected_words(&source).collect::<Vec<_>>().join("\n")
        })
        .collect();
    let mut sources = vec![Path::new(env!("CARGO_MANIFEST_DIR")).join("src")];
    let mut unchecked = Vec::new();
    let mut seen = 0;
    while let Some(path) = sources.pop() {
        if path.is_dir() {
            sources.extend(std::fs::read_dir(&path).unwrap().map(|e| e.unwrap().path()));
            continue;
        }
        for words in messages_in(&std::fs::read_to_string(&path).unwrap()) {
            seen += 1;
            if !expected
                .iter()
                .any(|case| words.iter().all(|w| case.contains(w.as_str())))
            {
                unchecked.push(format!("{}: {words:?}", path.display()));
            }
        }
    }
    assert!(
        seen >= 28,
        "found only {seen} messages: is the parsing right?"
    );
    assert!(
        unchecked.is_empty(),
        "messages no compile-fail program expects:\n{}",
        unchecked.join("\n")
    );
}
