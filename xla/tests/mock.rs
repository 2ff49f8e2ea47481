//! The loader's failure paths against a mock plugin (`xla/mock`, a `cdylib` exporting
//! `GetPjrtApi` with an adjustable version and table size): a file that is not a
//! plugin, another major version, an older minor version, a table too short for the
//! functions meshwork calls, and a plugin error that must be read and destroyed. CI
//! runs this file under valgrind's memcheck too (`cargo xtask valgrind`), where a
//! leaked or twice-destroyed `PJRT_Error` or a read past the table is an error.

#![allow(unsafe_code)] // only to call the mock's `mock_configure` before loading it

use std::path::{Path, PathBuf};

use meshwork_xla::{Code, Error, Plugin};

mod common {
    pub(crate) mod mock_plugin;
}
use common::mock_plugin::mock_library;

/// A copy of the mock of its own (its own statics) reporting `major.minor` and a
/// `PJRT_Api` of `size` bytes.
fn mock(dir: &Path, major: i32, minor: i32, size: usize) -> PathBuf {
    let path = dir.join(format!("mock-{major}-{minor}-{size}.so"));
    std::fs::copy(mock_library(), &path).unwrap();
    // SAFETY: the mock is this workspace's own test library; `mock_configure` is
    // `extern "C" fn(i32, i32, usize)`. The handle is leaked so that the loader's
    // later `dlopen` of the same path finds the configured copy.
    unsafe {
        let lib = libloading::Library::new(&path).unwrap();
        let configure: libloading::Symbol<'_, extern "C" fn(i32, i32, usize)> =
            lib.get(b"mock_configure\0").unwrap();
        configure(major, minor, size);
        std::mem::forget(lib);
    }
    path
}

/// A full 0.81 table: the head (40 bytes) and 118 function pointers.
const FULL: usize = 40 + 118 * 8;

#[test]
fn a_file_that_is_not_a_plugin_is_refused_with_its_path() {
    let dir = tempfile::tempdir().unwrap();
    let junk = dir.path().join("junk.so");
    std::fs::write(&junk, b"not an ELF file").unwrap();
    for path in [junk, dir.path().join("missing.so")] {
        match Plugin::load(&path) {
            Err(e @ Error::NotAPlugin { .. }) => {
                assert!(e.to_string().contains(path.to_str().unwrap()), "{e}");
            }
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn a_shared_library_without_get_pjrt_api_is_not_a_plugin() {
    // A real shared library, but not a plugin: libc.
    let libc = ["/lib/x86_64-linux-gnu/libc.so.6", "/usr/lib/x86_64-linux-gnu/libc.so.6"]
        .into_iter()
        .map(Path::new)
        .find(|p| p.exists())
        .expect("libc.so.6 on this Linux");
    let e = Plugin::load(libc).unwrap_err();
    assert!(e.to_string().contains("exports no `GetPjrtApi`"), "{e}");
}

#[test]
fn another_major_version_or_an_older_minor_version_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    for (major, minor) in [(1, 0), (0, 80), (-1, 81)] {
        match Plugin::load(&mock(dir.path(), major, minor, FULL)) {
            Err(e @ Error::Version { .. }) => {
                let text = e.to_string();
                assert!(text.contains(&format!("PJRT API {major}.{minor}")), "{text}");
                assert!(text.contains("0.81"), "{text}");
            }
            other => panic!("{major}.{minor}: {other:?}"),
        }
    }
    // A newer minor version loads (the API only grows).
    Plugin::load(&mock(dir.path(), 0, 115, FULL)).unwrap();
}

#[test]
fn a_table_too_short_for_a_function_is_refused_without_calling_beyond_it() {
    let dir = tempfile::tempdir().unwrap();
    // Up to and including slot 19: PJRT_Client_Compile (slot 20) lies beyond it.
    match Plugin::load(&mock(dir.path(), 0, 81, 40 + 20 * 8)) {
        Err(Error::Missing { function, .. }) => assert_eq!(function, "PJRT_Client_Compile"),
        other => panic!("{other:?}"),
    }
    // Shorter than the head itself.
    assert!(matches!(Plugin::load(&mock(dir.path(), 0, 81, 16)), Err(Error::NotAPlugin { .. })));
}

#[test]
fn a_plugin_error_carries_its_message_and_code_and_is_destroyed() {
    let dir = tempfile::tempdir().unwrap();
    let plugin = Plugin::load(&mock(dir.path(), 0, 81, FULL)).unwrap();
    assert_eq!(plugin.version(), (0, 81));
    assert!(plugin.attributes().unwrap().is_empty());
    for _ in 0..3 {
        match plugin.client(&[]) {
            Err(Error::Plugin { call, code, message }) => {
                assert_eq!(call, "PJRT_Client_Create");
                assert_eq!(code, Code::Other(14));
                assert_eq!(message, "mock plugin: no devices");
            }
            other => panic!("{other:?}"),
        }
    }
}

/// A store in memory that records what it was asked.
#[derive(Default)]
struct Recorded {
    values: std::sync::Mutex<std::collections::HashMap<Vec<u8>, Vec<u8>>>,
    asked: std::sync::Mutex<Vec<String>>,
}

impl meshwork_xla::KeyValueStore for Recorded {
    fn get(
        &self,
        key: &[u8],
        timeout: Option<std::time::Duration>,
    ) -> Result<Option<Vec<u8>>, String> {
        let key_text = String::from_utf8_lossy(key).into_owned();
        self.asked.lock().unwrap().push(format!("get {key_text} {timeout:?}"));
        Ok(self.values.lock().unwrap().get(key).cloned())
    }
    fn try_get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, String> {
        self.asked.lock().unwrap().push(format!("try_get {}", String::from_utf8_lossy(key)));
        Ok(self.values.lock().unwrap().get(key).cloned())
    }
    fn put(&self, key: &[u8], value: &[u8]) -> Result<(), String> {
        self.asked.lock().unwrap().push(format!("put {}", String::from_utf8_lossy(key)));
        self.values.lock().unwrap().insert(key.to_vec(), value.to_vec());
        Ok(())
    }
}

/// A client created with a key-value store reaches it through PJRT's callbacks: the
/// mock puts a value, gets it back (the copy handed to the plugin freed by its
/// deleter), and a missing key comes back as the plugin's error with the store's
/// words — under valgrind too, where a value or error leaked or freed twice fails.
#[test]
fn a_client_with_a_key_value_store_reaches_it_through_the_callbacks() {
    let dir = tempfile::tempdir().unwrap();
    let plugin = Plugin::load(&mock(dir.path(), 0, 81, FULL)).unwrap();
    let store = std::sync::Arc::new(Recorded::default());
    let e = plugin.client_with_store(&[], store.clone()).unwrap_err();
    let Error::Plugin { message, .. } = e else { panic!("{e:?}") };
    assert_eq!(
        message,
        "mock plugin: no devices; key-value store: put: ok; get: value hello; try_get: error \
         no value under \"mock/absent\" (code 5); get: error no value under \"mock/absent\" \
         within Some(10ms) (code 4)"
    );
    assert_eq!(
        *store.asked.lock().unwrap(),
        ["put mock/0", "get mock/0 None", "try_get mock/absent", "get mock/absent Some(10ms)"]
    );
    // Without a store the callbacks are absent, and the mock says only that.
    let Err(Error::Plugin { message, .. }) = plugin.client(&[]) else { panic!() };
    assert_eq!(message, "mock plugin: no devices");
}
