//! The mock PJRT plugin (`xla/mock`) as a file to load, for the tests of the loader
//! (`xla/tests/mock.rs`) and of the binary's refusals (`cli/tests/cli_xla.rs`, which
//! includes this file by path).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The mock plugin, built once (a nested cargo in a target directory of its own).
pub(crate) fn mock_library() -> &'static Path {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(|| {
        let target = Path::new(env!("CARGO_TARGET_TMPDIR")).join("mock-plugin");
        let status = Command::new(env!("CARGO"))
            .args(["build", "--quiet", "-p", "meshwork-pjrt-mock", "--target-dir"])
            .arg(&target)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .status()
            .expect("cargo runs");
        assert!(status.success(), "the mock plugin builds");
        target.join("debug").join("libmeshwork_pjrt_mock.so")
    })
}
