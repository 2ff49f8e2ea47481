//! A mock PJRT plugin: a `cdylib` exporting `GetPjrtApi`, for the failure paths of
//! `meshwork-xla`'s loader (tested in `xla/tests/mock.rs`, and under valgrind's
//! memcheck in CI, which a real 250 MB plugin would make too slow).
//!
//! What it is: a `PJRT_Api` table whose version and `struct_size` a test sets through
//! `mock_configure` before loading it (each test loads its own copy of the file, so
//! each copy has its own settings), where every function exists and returns a
//! heap-allocated `PJRT_Error` that the caller must destroy, except
//! `PJRT_Plugin_Initialize`, `PJRT_Plugin_Attributes` and the error functions.
//! What it is not: a device. `PJRT_Client_Create` fails with the message
//! `mock plugin: no devices` and code `UNAVAILABLE` — after exercising the key-value
//! callbacks it is given (a put, a get, a missing key both ways), its message then
//! saying what they gave.
//!
//! ```
//! // A test configures its copy before loading it by path (xla/tests/mock.rs); linked
//! // directly, the table is the same: `struct_size` first, then the version.
//! meshwork_pjrt_mock::mock_configure(0, 81, 40 + 118 * 8);
//! let api = meshwork_pjrt_mock::GetPjrtApi().cast::<usize>();
//! // SAFETY: the mock's table holds `struct_size` bytes, at least its first words.
//! let (size, version) = unsafe { (*api, *api.add(4)) };
//! assert_eq!(size, 40 + 118 * 8);
//! assert_eq!(version >> 32, 81);
//! ```

#![allow(unsafe_code, missing_docs)]

use std::ffi::{c_char, c_void};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};

/// Function slots in PJRT API 0.81's `PJRT_Api`.
const SLOTS: usize = 118;
/// `struct_size`, `extension_start`, and the version's four words.
const HEAD_WORDS: usize = 5;

static CONFIGURED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
static MAJOR: AtomicI32 = AtomicI32::new(0);
static MINOR: AtomicI32 = AtomicI32::new(81);
static SIZE: AtomicUsize = AtomicUsize::new((HEAD_WORDS + SLOTS) * 8);
/// The table as the plugin hands it out: exactly `struct_size` bytes on the heap (in
/// words), so that valgrind's memcheck flags a loader that reads past it.
static TABLE: OnceLock<&'static [usize]> = OnceLock::new();

/// A `PJRT_Error`: its message and code.
struct MockError {
    message: String,
    code: i32,
}

#[repr(C)]
struct Header {
    struct_size: usize,
    extension_start: *mut c_void,
}

/// Sets the version and `struct_size` the next `GetPjrtApi` reports (the first call
/// fixes them for this copy of the library). Without it, the environment's
/// `MOCK_PJRT_VERSION` (`major.minor`) and `MOCK_PJRT_STRUCT_SIZE` are read, for tests
/// that load the mock in another process (the `meshwork` binary's).
#[unsafe(no_mangle)]
pub extern "C" fn mock_configure(major: i32, minor: i32, struct_size: usize) {
    CONFIGURED.store(true, Ordering::SeqCst);
    MAJOR.store(major, Ordering::SeqCst);
    MINOR.store(minor, Ordering::SeqCst);
    SIZE.store(struct_size, Ordering::SeqCst);
}

fn error(message: &str, code: i32) -> *mut c_void {
    Box::into_raw(Box::new(MockError { message: message.to_owned(), code })).cast()
}

unsafe extern "C" fn error_destroy(args: *mut c_void) -> *mut c_void {
    // SAFETY: PJRT_Error_Destroy_Args { header, PJRT_Error* error }; the error was
    // made by `error` above and is destroyed once.
    unsafe {
        let err = *args.cast::<u8>().add(16).cast::<*mut MockError>();
        drop(Box::from_raw(err));
    }
    std::ptr::null_mut()
}

unsafe extern "C" fn error_message(args: *mut c_void) -> *mut c_void {
    // SAFETY: PJRT_Error_Message_Args { header, error, message (out), size (out) }.
    unsafe {
        let base = args.cast::<u8>();
        let err = &*(*base.add(16).cast::<*const MockError>());
        *base.add(24).cast::<*const c_char>() = err.message.as_ptr().cast();
        *base.add(32).cast::<usize>() = err.message.len();
    }
    std::ptr::null_mut()
}

unsafe extern "C" fn error_code(args: *mut c_void) -> *mut c_void {
    // SAFETY: PJRT_Error_GetCode_Args { header, error, code (out) }.
    unsafe {
        let base = args.cast::<u8>();
        let err = &*(*base.add(16).cast::<*const MockError>());
        *base.add(24).cast::<i32>() = err.code;
    }
    std::ptr::null_mut()
}

unsafe extern "C" fn ok(args: *mut c_void) -> *mut c_void {
    // SAFETY: every args struct starts with its size; a caller that passes a struct
    // smaller than the header is refused, as a real plugin refuses it.
    let size = unsafe { (*args.cast::<Header>()).struct_size };
    if size < size_of::<Header>() {
        error("mock plugin: args struct too small", 3)
    } else {
        std::ptr::null_mut()
    }
}

unsafe extern "C" fn attributes(args: *mut c_void) -> *mut c_void {
    // SAFETY: PJRT_Plugin_Attributes_Args { header, attributes (out), num (out) }.
    unsafe {
        let base = args.cast::<u8>();
        *base.add(16).cast::<*const c_void>() = std::ptr::null();
        *base.add(24).cast::<usize>() = 0;
    }
    std::ptr::null_mut()
}

/// `PJRT_CallbackError`, as the mock hands it to the key-value callbacks.
type MakeError = unsafe extern "C" fn(i32, *const c_char, usize) -> *mut c_void;

unsafe extern "C" fn make_error(code: i32, message: *const c_char, size: usize) -> *mut c_void {
    // SAFETY: the callback passes `size` bytes of its message, live for the call.
    let text = unsafe { std::slice::from_raw_parts(message.cast::<u8>(), size) };
    error(&String::from_utf8_lossy(text), code)
}

static MAKE_ERROR: MakeError = make_error;

/// A key-value callback's outcome: the value it gave (freed through its deleter), or
/// its error's message and code (the error destroyed).
///
/// # Safety
/// `args` is a get callback's args struct after the call (its value, size and
/// deleter the last three words), `error_at_null` what the call returned.
unsafe fn read_value(args: &[usize], error_at_null: *mut c_void) -> Result<Vec<u8>, String> {
    let n = args.len();
    if !error_at_null.is_null() {
        // SAFETY: made by `make_error` above, destroyed here once.
        let err = unsafe { Box::from_raw(error_at_null.cast::<MockError>()) };
        return Err(format!("{} (code {})", err.message, err.code));
    }
    let (value, size, deleter) = (args[n - 3], args[n - 2], args[n - 1]);
    // SAFETY: the callback set `value` to `size` bytes and a deleter for them.
    unsafe {
        let bytes = std::slice::from_raw_parts(value as *const u8, size).to_vec();
        let deleter: unsafe extern "C" fn(*mut c_char) = std::mem::transmute(deleter);
        deleter(value as *mut c_char);
        Ok(bytes)
    }
}

/// With key-value callbacks (a client that spans processes), puts `mock/0` = `hello`,
/// reads it back with `get`, then asks `try_get` and `get` (10 ms) for `mock/absent`;
/// the creation fails either way, its message saying what the callbacks gave.
unsafe extern "C" fn client_create(args: *mut c_void) -> *mut c_void {
    // SAFETY: PJRT_Client_Create_Args { header, create_options, num_options,
    // kv_get_callback, kv_get_user_arg, kv_put_callback, kv_put_user_arg, client,
    // kv_try_get_callback, kv_try_get_user_arg }: words 4..=10.
    let w = |k: usize| unsafe { *args.cast::<usize>().add(k) };
    let (size, get, get_arg, put, put_arg, try_get, try_arg) =
        (w(0), w(4), w(5), w(6), w(7), w(9), w(10));
    if put == 0 || get == 0 || size < 11 * 8 || try_get == 0 {
        return error("mock plugin: no devices", 14);
    }
    type Callback = unsafe extern "C" fn(*mut usize) -> *mut c_void;
    let make = (&raw const MAKE_ERROR) as usize;
    let (key, value, absent) = (b"mock/0", b"hello", b"mock/absent");
    // SAFETY: the callbacks meshwork gave, with their args structs laid out as the
    // header says (each starts with its size).
    let report = unsafe {
        let put: Callback = std::mem::transmute(put);
        let mut put_args = [
            8 * 8,
            0,
            key.as_ptr() as usize,
            key.len(),
            value.as_ptr() as usize,
            value.len(),
            make,
            put_arg,
        ];
        let put_error = put(put_args.as_mut_ptr());
        let get: Callback = std::mem::transmute(get);
        let mut get_args =
            [10 * 8, 0, key.as_ptr() as usize, key.len(), 0xFFFF_FFFF, make, get_arg, 0, 0, 0];
        let e = get(get_args.as_mut_ptr());
        let got = read_value(&get_args, e);
        let try_get: Callback = std::mem::transmute(try_get);
        let mut try_args =
            [9 * 8, 0, absent.as_ptr() as usize, absent.len(), make, try_arg, 0, 0, 0];
        let e = try_get(try_args.as_mut_ptr());
        let tried = read_value(&try_args, e);
        let mut wait_args =
            [10 * 8, 0, absent.as_ptr() as usize, absent.len(), 10, make, get_arg, 0, 0, 0];
        let e = get(wait_args.as_mut_ptr());
        let waited = read_value(&wait_args, e);
        let shown = |r: Result<Vec<u8>, String>| match r {
            Ok(v) => format!("value {}", String::from_utf8_lossy(&v)),
            Err(e) => format!("error {e}"),
        };
        format!(
            "put: {}; get: {}; try_get: {}; get: {}",
            if put_error.is_null() {
                "ok".to_string()
            } else {
                shown(read_value(&[0, 0, 0], put_error))
            },
            shown(got),
            shown(tried),
            shown(waited)
        )
    };
    error(&format!("mock plugin: no devices; key-value store: {report}"), 14)
}

unsafe extern "C" fn unimplemented(_args: *mut c_void) -> *mut c_void {
    error("mock plugin: not implemented", 12)
}

/// The version and size from `MOCK_PJRT_VERSION` and `MOCK_PJRT_STRUCT_SIZE`, where set.
fn from_environment() {
    if let Some((major, minor)) = std::env::var("MOCK_PJRT_VERSION")
        .ok()
        .and_then(|v| v.split_once('.').and_then(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?))))
    {
        MAJOR.store(major, Ordering::SeqCst);
        MINOR.store(minor, Ordering::SeqCst);
    }
    if let Some(size) = std::env::var("MOCK_PJRT_STRUCT_SIZE").ok().and_then(|v| v.parse().ok()) {
        SIZE.store(size, Ordering::SeqCst);
    }
}

/// The plugin's entry point.
#[unsafe(no_mangle)]
pub extern "C" fn GetPjrtApi() -> *const c_void {
    let table = TABLE.get_or_init(|| {
        if !CONFIGURED.load(Ordering::SeqCst) {
            from_environment();
        }
        type F = unsafe extern "C" fn(*mut c_void) -> *mut c_void;
        let mut words = [0usize; HEAD_WORDS + SLOTS];
        words[0] = SIZE.load(Ordering::SeqCst);
        words[2] = 24; // PJRT_Api_Version's struct_size
        let (major, minor) = (MAJOR.load(Ordering::SeqCst), MINOR.load(Ordering::SeqCst));
        words[4] = (major as u32 as usize) | ((minor as u32 as usize) << 32);
        let f = |g: F| g as usize;
        for slot in 0..SLOTS {
            words[HEAD_WORDS + slot] = f(unimplemented);
        }
        let size = words[0];
        for (slot, g) in [
            (0, error_destroy as F),
            (1, error_message),
            (2, error_code),
            (3, ok),
            (4, attributes),
            (10, client_create),
        ] {
            words[HEAD_WORDS + slot] = f(g);
        }
        // At least one word (the size itself), at most the whole table.
        let kept = size.div_ceil(8).clamp(1, words.len());
        let table: &'static [usize] = Box::leak(words[..kept].to_vec().into_boxed_slice());
        table
    });
    table.as_ptr().cast()
}
