//! The README's examples are the programs in `examples/` that
//! `scripts/test` runs: each ```rust block under an
//! `<!-- example: examples/NAME.rs -->` marker must be that file, its
//! leading `//!` comment aside, so the README shows code that runs as
//! written.

use std::path::Path;

#[test]
fn readme_examples_are_the_example_programs() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let marker = "<!-- example: ";
    let mut checked = Vec::new();
    for (at, _) in readme.match_indices(marker) {
        let rest = &readme[at + marker.len()..];
        let file = &rest[..rest.find(" -->").expect("a closed marker")];
        let block = rest.split_once("```rust\n").expect("a rust block after the marker").1;
        let block = &block[..block.find("```\n").expect("a closed block")];
        let source = std::fs::read_to_string(root.join(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
        let body: Vec<&str> =
            source.lines().skip_while(|l| l.starts_with("//!")).skip_while(|l| l.is_empty()).collect();
        assert_eq!(block.trim_end(), body.join("\n").trim_end(), "README's block for {file} differs from the file");
        checked.push(file.to_string());
    }
    assert_eq!(checked, ["examples/quickstart.rs", "examples/train_xor.rs", "examples/inference.rs"]);
}
