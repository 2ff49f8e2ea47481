//! The PJRT C API: a hand-declared subset of `pjrt_c_api.h` (API 0.81's layout) and
//! the safe handles over it. **All of this crate's `unsafe` is in this module.**
//!
//! How the plugin is kept honest:
//! - [`Plugin::load`] reads `PJRT_Api`'s version and refuses another major version or
//!   a minor version older than [`MIN_MINOR`]; every call goes through
//!   [`Api::function`], which refuses a function pointer that does not lie inside the
//!   plugin's `PJRT_Api.struct_size` (or is null).
//! - Every args struct is passed with its 0.81 `struct_size`: plugins accept a struct
//!   as large as theirs or larger, and read only what they know.
//! - Ownership: a [`Client`] keeps its plugin's library loaded; every [`Buffer`] and
//!   [`Executable`] keeps its client alive (an `Arc`), so dropping a client before its
//!   buffers destroys the client only after the last of them.
//! - A [`Buffer`] dropped while an execution still reads it is destroyed through
//!   `PJRT_Buffer_Destroy`, which PJRT defines as safe then: the runtime holds its own
//!   reference to the memory until the execution that reads it completes.

#![allow(unsafe_code)]

use std::ffi::{c_char, c_void};
use std::path::{Path, PathBuf};
use std::ptr;
use std::sync::Arc;

use meshwork_types::{DType, Tensor};

use crate::{Error, Result};

/// The PJRT major version meshwork binds.
pub const MAJOR: i32 = 0;
/// The oldest minor version accepted: the header the structs below are declared from.
pub const MIN_MINOR: i32 = 81;

// ---------------------------------------------------------------------------------
// Layout (from `pjrt_c_api.h`, API 0.81). Every args struct starts with
// `size_t struct_size; PJRT_Extension_Base* extension_start;`.
// ---------------------------------------------------------------------------------

type Raw = c_void;
/// Every API function: `PJRT_Error* f(Args*)`.
type Function = unsafe extern "C" fn(*mut c_void) -> *mut Raw;

/// A slot's C function that returns nothing: `PJRT_Error_Message` and
/// `PJRT_Error_Destroy` are `void (*)(Args*)` in `pjrt_c_api.h`, and calling one
/// through a pointer typed as returning a value would be undefined behaviour.
type VoidFunction = unsafe extern "C" fn(*mut c_void);

#[repr(C)]
struct ApiVersion {
    struct_size: usize,
    extension_start: *mut Raw,
    major: i32,
    minor: i32,
}

/// The head of `PJRT_Api`; the function pointers follow it in a fixed order.
#[repr(C)]
struct ApiHead {
    struct_size: usize,
    extension_start: *mut Raw,
    version: ApiVersion,
}

/// Slots of the functions used, by their position in `PJRT_Api` after the head.
#[derive(Debug, Clone, Copy)]
#[repr(usize)]
enum Slot {
    ErrorDestroy = 0,
    ErrorMessage = 1,
    ErrorGetCode = 2,
    PluginInitialize = 3,
    PluginAttributes = 4,
    EventDestroy = 5,
    EventAwait = 8,
    ClientCreate = 10,
    ClientDestroy = 11,
    ClientPlatformName = 12,
    ClientAddressableDevices = 16,
    ClientCompile = 20,
    ClientBufferFromHostBuffer = 22,
    DeviceDescriptionId = 23,
    DeviceDescriptionKind = 26,
    DeviceGetDescription = 29,
    DeviceMemoryStats = 34,
    ExecutableDestroy = 40,
    ExecutableNumOutputs = 44,
    ExecutableOptimizedProgram = 48,
    LoadedExecutableDestroy = 50,
    LoadedExecutableGetExecutable = 51,
    LoadedExecutableExecute = 55,
    BufferDestroy = 58,
    BufferElementType = 59,
    BufferDimensions = 60,
    BufferOnDeviceSizeInBytes = 64,
    BufferCopyToDevice = 69,
    BufferToHostBuffer = 70,
    TopologyCreate = 82,
    TopologyDestroy = 83,
    TopologyGetDeviceDescriptions = 86,
    Compile = 89,
    ExecutableGetCompiledMemoryStats = 96,
}

impl Slot {
    fn name(self) -> &'static str {
        match self {
            Slot::ErrorDestroy => "PJRT_Error_Destroy",
            Slot::ErrorMessage => "PJRT_Error_Message",
            Slot::ErrorGetCode => "PJRT_Error_GetCode",
            Slot::PluginInitialize => "PJRT_Plugin_Initialize",
            Slot::PluginAttributes => "PJRT_Plugin_Attributes",
            Slot::EventDestroy => "PJRT_Event_Destroy",
            Slot::EventAwait => "PJRT_Event_Await",
            Slot::ClientCreate => "PJRT_Client_Create",
            Slot::ClientDestroy => "PJRT_Client_Destroy",
            Slot::ClientPlatformName => "PJRT_Client_PlatformName",
            Slot::ClientAddressableDevices => "PJRT_Client_AddressableDevices",
            Slot::ClientCompile => "PJRT_Client_Compile",
            Slot::ClientBufferFromHostBuffer => "PJRT_Client_BufferFromHostBuffer",
            Slot::DeviceDescriptionId => "PJRT_DeviceDescription_Id",
            Slot::DeviceDescriptionKind => "PJRT_DeviceDescription_Kind",
            Slot::DeviceGetDescription => "PJRT_Device_GetDescription",
            Slot::DeviceMemoryStats => "PJRT_Device_MemoryStats",
            Slot::ExecutableDestroy => "PJRT_Executable_Destroy",
            Slot::ExecutableNumOutputs => "PJRT_Executable_NumOutputs",
            Slot::ExecutableOptimizedProgram => "PJRT_Executable_OptimizedProgram",
            Slot::LoadedExecutableDestroy => "PJRT_LoadedExecutable_Destroy",
            Slot::LoadedExecutableGetExecutable => "PJRT_LoadedExecutable_GetExecutable",
            Slot::LoadedExecutableExecute => "PJRT_LoadedExecutable_Execute",
            Slot::BufferDestroy => "PJRT_Buffer_Destroy",
            Slot::BufferElementType => "PJRT_Buffer_ElementType",
            Slot::BufferDimensions => "PJRT_Buffer_Dimensions",
            Slot::BufferOnDeviceSizeInBytes => "PJRT_Buffer_OnDeviceSizeInBytes",
            Slot::BufferCopyToDevice => "PJRT_Buffer_CopyToDevice",
            Slot::BufferToHostBuffer => "PJRT_Buffer_ToHostBuffer",
            Slot::TopologyCreate => "PJRT_TopologyDescription_Create",
            Slot::TopologyDestroy => "PJRT_TopologyDescription_Destroy",
            Slot::TopologyGetDeviceDescriptions => "PJRT_TopologyDescription_GetDeviceDescriptions",
            Slot::Compile => "PJRT_Compile",
            Slot::ExecutableGetCompiledMemoryStats => "PJRT_Executable_GetCompiledMemoryStats",
        }
    }
}

/// Declares an args struct: `struct_size` and `extension_start` first, then the
/// fields, with a `new()` that zeroes everything and sets `struct_size`.
macro_rules! args {
    ($name:ident { $($field:ident : $ty:ty),* $(,)? }) => {
        #[repr(C)]
        struct $name {
            struct_size: usize,
            extension_start: *mut Raw,
            $($field: $ty),*
        }
        impl $name {
            fn new() -> $name {
                // SAFETY: every field is a pointer, an integer, a bool or an
                // `Option` of a function pointer, for all of which all-zero bytes are
                // a valid value (null, 0, false, None).
                let mut a: $name = unsafe { std::mem::zeroed() };
                a.struct_size = std::mem::size_of::<$name>();
                a
            }
        }
    };
}

args!(ErrorDestroyArgs { error: *mut Raw });
args!(ErrorMessageArgs { error: *const Raw, message: *const c_char, message_size: usize });
args!(ErrorGetCodeArgs { error: *const Raw, code: i32 });
args!(PluginInitializeArgs {});
args!(PluginAttributesArgs { attributes: *const NamedValue, num_attributes: usize });
args!(EventDestroyArgs { event: *mut Raw });
args!(EventAwaitArgs { event: *mut Raw });
args!(ClientCreateArgs {
    create_options: *const NamedValue,
    num_options: usize,
    kv_get_callback: *mut Raw,
    kv_get_user_arg: *mut Raw,
    kv_put_callback: *mut Raw,
    kv_put_user_arg: *mut Raw,
    client: *mut Raw,
    kv_try_get_callback: *mut Raw,
    kv_try_get_user_arg: *mut Raw,
});
args!(ClientDestroyArgs { client: *mut Raw });
args!(ClientPlatformNameArgs { client: *mut Raw, name: *const c_char, name_size: usize });
args!(ClientAddressableDevicesArgs {
    client: *mut Raw,
    devices: *const *mut Raw,
    num_devices: usize,
});
args!(ProgramArgs {
    code: *mut c_char,
    code_size: usize,
    format: *const c_char,
    format_size: usize,
});
args!(ClientCompileArgs {
    client: *mut Raw,
    program: *const ProgramArgs,
    compile_options: *const c_char,
    compile_options_size: usize,
    executable: *mut Raw,
});
args!(BufferFromHostArgs {
    client: *mut Raw,
    data: *const c_void,
    kind: i32,
    dims: *const i64,
    num_dims: usize,
    byte_strides: *const i64,
    num_byte_strides: usize,
    semantics: i32,
    device: *mut Raw,
    memory: *mut Raw,
    device_layout: *mut Raw,
    done_with_host_buffer: *mut Raw,
    buffer: *mut Raw,
});
args!(DeviceGetDescriptionArgs { device: *mut Raw, description: *mut Raw });
args!(DescriptionIdArgs { description: *mut Raw, id: i32 });
args!(DescriptionKindArgs { description: *mut Raw, kind: *const c_char, kind_size: usize });
args!(DeviceMemoryStatsArgs {
    device: *mut Raw,
    bytes_in_use: i64,
    peak_bytes_in_use: i64,
    peak_bytes_in_use_is_set: bool,
    num_allocs: i64,
    num_allocs_is_set: bool,
    largest_alloc_size: i64,
    largest_alloc_size_is_set: bool,
    bytes_limit: i64,
    bytes_limit_is_set: bool,
    bytes_reserved: i64,
    bytes_reserved_is_set: bool,
    peak_bytes_reserved: i64,
    peak_bytes_reserved_is_set: bool,
    bytes_reservable_limit: i64,
    bytes_reservable_limit_is_set: bool,
    largest_free_block_bytes: i64,
    largest_free_block_bytes_is_set: bool,
    pool_bytes: i64,
    pool_bytes_is_set: bool,
    peak_pool_bytes: i64,
    peak_pool_bytes_is_set: bool,
});
args!(ExecutableDestroyArgs { executable: *mut Raw });
args!(ExecutableNumOutputsArgs { executable: *mut Raw, num_outputs: usize });
args!(ExecutableOptimizedProgramArgs { executable: *mut Raw, program: *mut ProgramArgs });
args!(LoadedDestroyArgs { executable: *mut Raw });
args!(LoadedGetExecutableArgs { loaded: *mut Raw, executable: *mut Raw });
args!(ExecuteOptions {
    send_callbacks: *mut Raw,
    recv_callbacks: *mut Raw,
    num_send_ops: usize,
    num_recv_ops: usize,
    launch_id: i32,
    non_donatable_input_indices: *const i64,
    num_non_donatable_input_indices: usize,
    context: *mut Raw,
    call_location: *const c_char,
    num_tasks: usize,
    task_ids: *mut i32,
    incarnation_ids: *mut i64,
});
args!(ExecuteArgs {
    executable: *mut Raw,
    options: *mut ExecuteOptions,
    argument_lists: *const *const *mut Raw,
    num_devices: usize,
    num_args: usize,
    output_lists: *const *mut *mut Raw,
    device_complete_events: *mut *mut Raw,
    execute_device: *mut Raw,
});
args!(BufferDestroyArgs { buffer: *mut Raw });
args!(BufferElementTypeArgs { buffer: *mut Raw, kind: i32 });
args!(BufferCopyToDeviceArgs { buffer: *mut Raw, dst_device: *mut Raw, dst_buffer: *mut Raw });
args!(BufferDimensionsArgs { buffer: *mut Raw, dims: *const i64, num_dims: usize });
args!(BufferSizeArgs { buffer: *mut Raw, size: usize });
args!(BufferToHostArgs {
    src: *mut Raw,
    host_layout: *mut Raw,
    dst: *mut c_void,
    dst_size: usize,
    event: *mut Raw,
});

args!(TopologyCreateArgs {
    topology_name: *const c_char,
    topology_name_size: usize,
    create_options: *const NamedValue,
    num_options: usize,
    topology: *mut Raw,
});
args!(TopologyDestroyArgs { topology: *mut Raw });
args!(TopologyDescriptionsArgs {
    topology: *mut Raw,
    descriptions: *const *mut Raw,
    num_descriptions: usize,
});
args!(CompileArgs {
    topology: *const Raw,
    program: *const ProgramArgs,
    compile_options: *const c_char,
    compile_options_size: usize,
    client: *mut Raw,
    executable: *mut Raw,
});
args!(CompiledMemoryStatsArgs {
    executable: *mut Raw,
    generated_code_size_in_bytes: i64,
    argument_size_in_bytes: i64,
    output_size_in_bytes: i64,
    alias_size_in_bytes: i64,
    temp_size_in_bytes: i64,
    host_generated_code_size_in_bytes: i64,
    host_argument_size_in_bytes: i64,
    host_output_size_in_bytes: i64,
    host_alias_size_in_bytes: i64,
    host_temp_size_in_bytes: i64,
    peak_memory_in_bytes: i64,
    total_size_in_bytes: i64,
});

/// `PJRT_NamedValue`: a create option or a plugin attribute.
#[repr(C)]
struct NamedValue {
    struct_size: usize,
    extension_start: *mut Raw,
    name: *const c_char,
    name_size: usize,
    kind: i32,
    /// The union: a string, an int64, an int64 array, a float or a bool.
    value: NamedUnion,
    value_size: usize,
}

#[repr(C)]
#[derive(Clone, Copy)]
union NamedUnion {
    string: *const c_char,
    int64: i64,
    int64_array: *const i64,
    float: f32,
    /// C's `bool`, read as a byte so that any value the plugin writes is valid.
    boolean: u8,
}

const NAMED_STRING: i32 = 0;
const NAMED_INT64: i32 = 1;
const NAMED_INT64_LIST: i32 = 2;
const NAMED_FLOAT: i32 = 3;
const NAMED_BOOL: i32 = 4;

/// `PJRT_HostBufferSemantics_kImmutableOnlyDuringCall`: the plugin copies the host
/// data before `BufferFromHostBuffer` returns.
const IMMUTABLE_ONLY_DURING_CALL: i32 = 0;

/// `PJRT_Buffer_Type` of a dtype.
fn buffer_type(dtype: DType) -> i32 {
    match dtype {
        DType::Bool => 1,
        DType::I8 => 2,
        DType::I16 => 3,
        DType::I32 => 4,
        DType::I64 => 5,
        DType::U8 => 6,
        DType::U16 => 7,
        DType::U32 => 8,
        DType::U64 => 9,
        DType::F16 => 10,
        DType::F32 => 11,
        DType::F64 => 12,
        DType::BF16 => 13,
    }
}

/// The dtype of a `PJRT_Buffer_Type`, if meshwork has it.
fn dtype_of(kind: i32) -> Option<DType> {
    DType::ALL.into_iter().find(|&d| buffer_type(d) == kind)
}

// ---------------------------------------------------------------------------------
// The loaded API.
// ---------------------------------------------------------------------------------

/// A loaded plugin's function table. Kept alive with its library.
struct Api {
    /// The plugin's `PJRT_Api`, valid while `_library` is loaded.
    table: *const ApiHead,
    /// Its `struct_size`: no function pointer at or beyond it is read.
    size: usize,
    path: PathBuf,
    version: (i32, i32),
    /// Last field, so that it is unloaded after everything above is dropped.
    _library: libloading::Library,
}

// SAFETY: the API table is immutable after `GetPjrtApi` returns, and PJRT's C API is
// thread-safe: clients, buffers and executables may be used from any thread.
unsafe impl Send for Api {}
// SAFETY: as above; `&Api` only reads the table.
unsafe impl Sync for Api {}

impl Api {
    /// The function in `slot`, or [`Error::Missing`] when the plugin's table ends
    /// before it or leaves it null.
    /// Where `slot`'s pointer lies in the table, checked inside the table's own size.
    fn slot_offset(&self, slot: Slot) -> Result<usize> {
        let offset = size_of::<ApiHead>() + slot as usize * size_of::<usize>();
        if offset + size_of::<usize>() > self.size {
            return Err(Error::Missing { path: self.path.clone(), function: slot.name() });
        }
        Ok(offset)
    }

    fn function(&self, slot: Slot) -> Result<Function> {
        let offset = self.slot_offset(slot)?;
        // SAFETY: `table` points to the plugin's `PJRT_Api`, at least `size` bytes
        // long (its own `struct_size`), and the slot lies inside it (checked above).
        // Each slot is a nullable C function pointer `PJRT_Error* (*)(Args*)`, which
        // `Option<Function>` represents exactly; unaligned reads are not needed as
        // the struct is pointer-aligned.
        let f: Option<Function> =
            unsafe { ptr::read(self.table.cast::<u8>().add(offset).cast::<Option<Function>>()) };
        f.ok_or(Error::Missing { path: self.path.clone(), function: slot.name() })
    }

    /// The function of a slot whose C type returns `void` ([`VoidFunction`]): the
    /// slot checked as [`function`](Self::function) checks it.
    fn void_function(&self, slot: Slot) -> Result<VoidFunction> {
        debug_assert!(matches!(slot, Slot::ErrorMessage | Slot::ErrorDestroy));
        let offset = self.slot_offset(slot)?;
        // SAFETY: as in `function`: the slot lies inside the plugin's table, and holds a
        // nullable C function pointer, here of type `void (*)(Args*)`, which
        // `Option<VoidFunction>` represents exactly.
        let f: Option<VoidFunction> = unsafe {
            ptr::read(self.table.cast::<u8>().add(offset).cast::<Option<VoidFunction>>())
        };
        f.ok_or(Error::Missing { path: self.path.clone(), function: slot.name() })
    }

    /// Calls `slot` with `args` and turns a returned `PJRT_Error` into
    /// [`Error::Plugin`].
    ///
    /// Callers pass the args struct that the slot's function takes (each wrapper
    /// below pairs them by name), with every pointer in it valid for the call.
    fn call<A>(&self, slot: Slot, args: &mut A) -> Result<()> {
        let f = self.function(slot)?;
        // SAFETY: `f` is the plugin's function for `slot`; `args` is the `#[repr(C)]`
        // struct with that function's argument layout (0.81), `struct_size` set, and
        // live for the call. The plugin reads no further than its own struct size.
        let error = unsafe { f((args as *mut A).cast::<c_void>()) };
        if error.is_null() { Ok(()) } else { Err(self.take_error(slot.name(), error)) }
    }

    /// Reads and destroys a `PJRT_Error`.
    fn take_error(&self, call: &'static str, error: *mut Raw) -> Error {
        let mut message = ErrorMessageArgs::new();
        message.error = error;
        let mut code = ErrorGetCodeArgs::new();
        code.error = error;
        let text = match self.void_function(Slot::ErrorMessage) {
            Ok(f) => {
                // SAFETY: `error` is the live error the plugin just returned; the
                // message it points `message` at lives until the error is destroyed,
                // and is copied out before that.
                unsafe { f((&mut message as *mut ErrorMessageArgs).cast()) };
                copy_str(message.message, message.message_size)
            }
            Err(_) => String::from("(the plugin has no PJRT_Error_Message)"),
        };
        let destroy = |e: *mut Raw| {
            if let Ok(f) = self.void_function(Slot::ErrorDestroy) {
                let mut destroy = ErrorDestroyArgs::new();
                destroy.error = e;
                // SAFETY: `e` is a live error the plugin returned, destroyed exactly
                // once, here (its message was copied out before).
                unsafe { f((&mut destroy as *mut ErrorDestroyArgs).cast()) };
            }
        };
        if let Ok(f) = self.function(Slot::ErrorGetCode) {
            // SAFETY: as above; the call only writes `code.code`.
            let nested = unsafe { f((&mut code as *mut ErrorGetCodeArgs).cast()) };
            if !nested.is_null() {
                // Getting the code failed: UNKNOWN, and that error destroyed too (not
                // read, so no recursion).
                code.code = 2;
                destroy(nested);
            }
        }
        destroy(error);
        Error::Plugin { call, code: Code::from_raw(code.code), message: text }
    }

    /// Awaits and destroys an event; its error, if any, as [`Error::Plugin`].
    fn await_event(&self, call: &'static str, event: *mut Raw) -> Result<()> {
        if event.is_null() {
            return Ok(());
        }
        let mut wait = EventAwaitArgs::new();
        wait.event = event;
        let waited = self.call(Slot::EventAwait, &mut wait);
        let mut destroy = EventDestroyArgs::new();
        destroy.event = event;
        let destroyed = self.call(Slot::EventDestroy, &mut destroy);
        waited.map_err(|e| e.during(call)).and(destroyed)
    }
}

/// Copies a `(pointer, length)` string out of plugin memory (lossy UTF-8).
fn copy_str(p: *const c_char, len: usize) -> String {
    if p.is_null() || len == 0 {
        return String::new();
    }
    // SAFETY: the plugin returned `p` with `len` readable bytes, valid until the
    // object that owns them is destroyed, which the callers do after this copy.
    let bytes = unsafe { std::slice::from_raw_parts(p.cast::<u8>(), len) };
    String::from_utf8_lossy(bytes).into_owned()
}

/// A PJRT error code (`PJRT_Error_Code`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    /// `CANCELLED`.
    Cancelled,
    /// `INVALID_ARGUMENT`: the program or an argument is wrong.
    InvalidArgument,
    /// `NOT_FOUND`.
    NotFound,
    /// `RESOURCE_EXHAUSTED`: the device is out of memory.
    ResourceExhausted,
    /// `FAILED_PRECONDITION`: for example a buffer already donated or deleted.
    FailedPrecondition,
    /// `UNIMPLEMENTED`.
    Unimplemented,
    /// `INTERNAL`.
    Internal,
    /// Any other code (its number).
    Other(i32),
}

impl Code {
    fn from_raw(code: i32) -> Code {
        match code {
            1 => Code::Cancelled,
            3 => Code::InvalidArgument,
            5 => Code::NotFound,
            8 => Code::ResourceExhausted,
            9 => Code::FailedPrecondition,
            12 => Code::Unimplemented,
            13 => Code::Internal,
            other => Code::Other(other),
        }
    }
}

// ---------------------------------------------------------------------------------
// Plugin.
// ---------------------------------------------------------------------------------

/// A value of a plugin attribute or a client create option.
#[derive(Debug, Clone, PartialEq)]
pub enum NamedValueOf {
    /// A string.
    Str(String),
    /// An int64.
    Int(i64),
    /// A list of int64.
    Ints(Vec<i64>),
    /// A float.
    Float(f32),
    /// A bool.
    Bool(bool),
    /// A value of a kind this binding does not know (its tag), from a newer plugin.
    Unknown(i32),
}

/// A loaded PJRT plugin (a shared library exporting `GetPjrtApi`), initialized once.
#[derive(Clone)]
pub struct Plugin {
    api: Arc<Api>,
}

impl std::fmt::Debug for Plugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Plugin({}, PJRT {}.{})",
            self.api.path.display(),
            self.api.version.0,
            self.api.version.1
        )
    }
}

impl Plugin {
    /// Loads the plugin at `path`: opens the library, calls `GetPjrtApi`, checks the
    /// API version (major [`MAJOR`], minor at least [`MIN_MINOR`]) and that the table
    /// holds every function meshwork calls, then runs `PJRT_Plugin_Initialize`.
    ///
    /// A plugin stays loaded for the rest of the process, as JAX keeps its plugins: a
    /// second load of the same file returns the first (initialized once), and the
    /// library is never unloaded under the threads and static state it started.
    ///
    /// The path is the file the user named: a bare name is a file in the working
    /// directory, never one the loader's search path finds. Before anything maps it,
    /// the file is checked ([`meshwork_io::elf`]): a regular file (a FIFO is refused
    /// without waiting), a shared object for this machine, every loadable segment and
    /// the section table inside it (a truncated library would crash the process with
    /// SIGBUS when mapped).
    pub fn load(path: &Path) -> Result<Plugin> {
        let explicit = as_written(path);
        let path = explicit.as_path();
        meshwork_io::elf::check(path)
            .map_err(|reason| Error::NotAPlugin { path: path.to_owned(), reason })?;
        static LOADED: std::sync::Mutex<Vec<(PathBuf, Arc<Api>)>> =
            std::sync::Mutex::new(Vec::new());
        let key = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_owned());
        let mut loaded = LOADED.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((_, api)) = loaded.iter().find(|(p, _)| *p == key) {
            return Ok(Plugin { api: Arc::clone(api) });
        }
        let plugin = Plugin::load_new(path)?;
        loaded.push((key, Arc::clone(&plugin.api)));
        Ok(plugin)
    }

    fn load_new(path: &Path) -> Result<Plugin> {
        let not_a_plugin = |reason: String| Error::NotAPlugin { path: path.to_owned(), reason };
        // SAFETY: loading a library runs its initializers. The path is one the user
        // named as a PJRT plugin; a library that is not one is refused below before
        // any other code of it runs (its initializers are the risk the user takes by
        // naming it, as with `LD_PRELOAD` or Python's `import`).
        let library =
            unsafe { libloading::Library::new(path) }.map_err(|e| not_a_plugin(e.to_string()))?;
        // SAFETY: `GetPjrtApi` is declared `const PJRT_Api* GetPjrtApi(void)` by the
        // PJRT plugin interface; the symbol's type is only trusted after it is found.
        let table = {
            let get: libloading::Symbol<'_, unsafe extern "C" fn() -> *const ApiHead> =
                unsafe { library.get(b"GetPjrtApi\0") }
                    .map_err(|_| not_a_plugin("it exports no `GetPjrtApi`".into()))?;
            // SAFETY: calling the plugin's entry point, which takes nothing and returns
            // a pointer to its static API table (or null).
            unsafe { get() }
        };
        // From here the plugin's code has run: whatever it started (threads, static
        // state) keeps its code, so a plugin refused now stays loaded, never unloaded
        // under it.
        let head = Self::check_head(table, path);
        let (size, major, minor) = match head {
            Ok(h) => h,
            Err(e) => {
                std::mem::forget(library);
                return Err(e);
            }
        };
        let api =
            Api { table, size, path: path.to_owned(), version: (major, minor), _library: library };
        let ready = ALL_SLOTS
            .iter()
            .try_for_each(|&slot| api.function(slot).map(drop))
            .and_then(|()| api.call(Slot::PluginInitialize, &mut PluginInitializeArgs::new()));
        if let Err(e) = ready {
            // Only the library is kept (never unloaded); the rest is freed.
            let Api { _library: library, .. } = api;
            std::mem::forget(library);
            return Err(e);
        }
        Ok(Plugin { api: Arc::new(api) })
    }

    /// The table's size and version, checked: `(struct_size, major, minor)`.
    fn check_head(table: *const ApiHead, path: &Path) -> Result<(usize, i32, i32)> {
        let not_a_plugin = |reason: String| Error::NotAPlugin { path: path.to_owned(), reason };
        if table.is_null() {
            return Err(not_a_plugin("`GetPjrtApi` returned null".into()));
        }
        // SAFETY: `table` is non-null and points to a `PJRT_Api`, which starts with
        // its `size_t struct_size` in every API version; read by value, before
        // anything else of it.
        let size = unsafe { ptr::read(table.cast::<usize>()) };
        if size < size_of::<ApiHead>() {
            return Err(not_a_plugin(format!("its PJRT_Api is {size} bytes, too small")));
        }
        // SAFETY: the table is at least as long as the head (checked just above),
        // which holds the version; read by value.
        let (major, minor) = unsafe {
            let head = ptr::read(table);
            (head.version.major, head.version.minor)
        };
        if major != MAJOR || minor < MIN_MINOR {
            return Err(Error::Version { path: path.to_owned(), major, minor });
        }
        Ok((size, major, minor))
    }

    /// The plugin's file.
    pub fn path(&self) -> &Path {
        &self.api.path
    }

    /// The plugin's PJRT API version `(major, minor)`.
    pub fn version(&self) -> (i32, i32) {
        self.api.version
    }

    /// The plugin's attributes (`xla_version`, `stablehlo_current_version`, …).
    pub fn attributes(&self) -> Result<Vec<(String, NamedValueOf)>> {
        let mut args = PluginAttributesArgs::new();
        self.api.call(Slot::PluginAttributes, &mut args)?;
        if args.attributes.is_null() {
            return Ok(Vec::new());
        }
        // SAFETY: the plugin returned an array of `num_attributes` named values that
        // lives as long as the plugin; each is read by value and its data copied.
        let values = unsafe { std::slice::from_raw_parts(args.attributes, args.num_attributes) };
        Ok(values.iter().map(|v| (copy_str(v.name, v.name_size), read_named(v))).collect())
    }

    /// Creates a client with `options` (the CPU plugin reads `cpu_device_count`).
    pub fn client(&self, options: &[(&str, NamedValueOf)]) -> Result<Client> {
        self.create_client(options, None)
    }

    /// Creates a client of a plugin that spans processes (the GPU plugin's, with
    /// `node_id` and `num_nodes` among `options`), its processes exchanging what
    /// they must through `store`: PJRT's key-value callbacks call it, during the
    /// creation and for as long as the client lives (which keeps `store` alive).
    pub fn client_with_store(
        &self,
        options: &[(&str, NamedValueOf)],
        store: Arc<dyn KeyValueStore>,
    ) -> Result<Client> {
        self.create_client(options, Some(Box::new(store)))
    }

    fn create_client(
        &self,
        options: &[(&str, NamedValueOf)],
        store: Option<Box<Arc<dyn KeyValueStore>>>,
    ) -> Result<Client> {
        // The strings and arrays the named values point into, alive for the call.
        let named = named_values(options)?;
        let mut args = ClientCreateArgs::new();
        args.create_options = named.as_ptr();
        args.num_options = named.len();
        if let Some(store) = &store {
            // The boxed `Arc` does not move when the box does: its address stays valid
            // for as long as the client keeps the box.
            let user_arg: *const Arc<dyn KeyValueStore> = &**store;
            let user_arg = user_arg.cast_mut().cast::<Raw>();
            args.kv_get_callback = kv_get as *mut Raw;
            args.kv_get_user_arg = user_arg;
            args.kv_put_callback = kv_put as *mut Raw;
            args.kv_put_user_arg = user_arg;
            args.kv_try_get_callback = kv_try_get as *mut Raw;
            args.kv_try_get_user_arg = user_arg;
        }
        self.api.call(Slot::ClientCreate, &mut args)?;
        if args.client.is_null() {
            return Err(Error::Plugin {
                call: "PJRT_Client_Create",
                code: Code::Internal,
                message: "returned no client".into(),
            });
        }
        let inner = Arc::new(ClientInner {
            api: Arc::clone(&self.api),
            raw: args.client,
            moved: Default::default(),
            _store: store.map(std::panic::AssertUnwindSafe),
        });
        let mut devices_args = ClientAddressableDevicesArgs::new();
        devices_args.client = inner.raw;
        self.api.call(Slot::ClientAddressableDevices, &mut devices_args)?;
        let raw_devices: Vec<*mut Raw> = if devices_args.devices.is_null() {
            Vec::new()
        } else {
            // SAFETY: the client owns an array of `num_devices` device pointers that
            // lives as long as the client; the pointers are copied out.
            unsafe { std::slice::from_raw_parts(devices_args.devices, devices_args.num_devices) }
                .to_vec()
        };
        let mut devices = Vec::with_capacity(raw_devices.len());
        for raw in raw_devices {
            let mut d = DeviceGetDescriptionArgs::new();
            d.device = raw;
            self.api.call(Slot::DeviceGetDescription, &mut d)?;
            let mut id = DescriptionIdArgs::new();
            id.description = d.description;
            self.api.call(Slot::DeviceDescriptionId, &mut id)?;
            let mut kind = DescriptionKindArgs::new();
            kind.description = d.description;
            self.api.call(Slot::DeviceDescriptionKind, &mut kind)?;
            devices.push(Device {
                client: Arc::clone(&inner),
                raw,
                id: id.id,
                kind: copy_str(kind.kind, kind.kind_size),
            });
        }
        let mut name = ClientPlatformNameArgs::new();
        name.client = inner.raw;
        self.api.call(Slot::ClientPlatformName, &mut name)?;
        let platform = copy_str(name.name, name.name_size);
        Ok(Client { inner, devices, platform })
    }
}

/// `options` as `PJRT_NamedValue`s pointing into them (alive while `options` is); an
/// option without a value to send is refused.
fn named_values(options: &[(&str, NamedValueOf)]) -> Result<Vec<NamedValue>> {
    if let Some((name, _)) = options.iter().find(|(_, v)| matches!(v, NamedValueOf::Unknown(_))) {
        return Err(Error::Arguments(format!("create option {name} has no value to send")));
    }
    Ok(options
        .iter()
        .map(|(name, value)| {
            let mut v = NamedValue {
                struct_size: size_of::<NamedValue>(),
                extension_start: ptr::null_mut(),
                name: name.as_ptr().cast(),
                name_size: name.len(),
                kind: NAMED_INT64,
                value: NamedUnion { int64: 0 },
                value_size: 1,
            };
            match value {
                NamedValueOf::Str(s) => {
                    (v.kind, v.value, v.value_size) =
                        (NAMED_STRING, NamedUnion { string: s.as_ptr().cast() }, s.len());
                }
                NamedValueOf::Int(i) => v.value = NamedUnion { int64: *i },
                NamedValueOf::Ints(l) => {
                    (v.kind, v.value, v.value_size) =
                        (NAMED_INT64_LIST, NamedUnion { int64_array: l.as_ptr() }, l.len());
                }
                NamedValueOf::Float(f) => {
                    (v.kind, v.value) = (NAMED_FLOAT, NamedUnion { float: *f });
                }
                NamedValueOf::Unknown(_) => {} // refused above
                NamedValueOf::Bool(b) => {
                    (v.kind, v.value) = (NAMED_BOOL, NamedUnion { boolean: u8::from(*b) });
                }
            }
            v
        })
        .collect())
}

/// Every slot, checked at load time so that a short table fails there, not mid-run.
const ALL_SLOTS: [Slot; 29] = [
    Slot::ErrorDestroy,
    Slot::ErrorMessage,
    Slot::ErrorGetCode,
    Slot::PluginInitialize,
    Slot::PluginAttributes,
    Slot::EventDestroy,
    Slot::EventAwait,
    Slot::ClientCreate,
    Slot::ClientDestroy,
    Slot::ClientPlatformName,
    Slot::ClientAddressableDevices,
    Slot::ClientCompile,
    Slot::ClientBufferFromHostBuffer,
    Slot::DeviceDescriptionId,
    Slot::DeviceDescriptionKind,
    Slot::DeviceGetDescription,
    Slot::DeviceMemoryStats,
    Slot::ExecutableDestroy,
    Slot::ExecutableNumOutputs,
    Slot::ExecutableOptimizedProgram,
    Slot::LoadedExecutableDestroy,
    Slot::LoadedExecutableGetExecutable,
    Slot::LoadedExecutableExecute,
    Slot::BufferDestroy,
    Slot::BufferElementType,
    Slot::BufferDimensions,
    Slot::BufferOnDeviceSizeInBytes,
    Slot::BufferCopyToDevice,
    Slot::BufferToHostBuffer,
];

/// Reads a named value's union by its tag.
fn read_named(v: &NamedValue) -> NamedValueOf {
    // SAFETY: the tag says which union field the plugin wrote; arrays and strings
    // have `value_size` elements and live as long as the plugin.
    unsafe {
        match v.kind {
            NAMED_STRING => NamedValueOf::Str(copy_str(v.value.string, v.value_size)),
            NAMED_INT64 => NamedValueOf::Int(v.value.int64),
            NAMED_INT64_LIST if !v.value.int64_array.is_null() => NamedValueOf::Ints(
                std::slice::from_raw_parts(v.value.int64_array, v.value_size).to_vec(),
            ),
            NAMED_INT64_LIST => NamedValueOf::Ints(Vec::new()),
            NAMED_FLOAT => NamedValueOf::Float(v.value.float),
            NAMED_BOOL => NamedValueOf::Bool(v.value.boolean != 0),
            other => NamedValueOf::Unknown(other),
        }
    }
}

// ---------------------------------------------------------------------------------
// Client, devices.
// ---------------------------------------------------------------------------------

/// The client itself; destroyed when its last handle (client, buffer, executable) is.
struct ClientInner {
    api: Arc<Api>,
    raw: *mut Raw,
    /// Bytes moved by this binding's calls: host to device, device to host, device
    /// to device.
    moved: [std::sync::atomic::AtomicU64; 3],
    /// The key-value store the client's callbacks reach (their `user_arg` points at
    /// it), dropped after the client is destroyed (fields drop after `drop`). Only
    /// the callbacks use it, each inside `catch_unwind`.
    _store: Option<std::panic::AssertUnwindSafe<Box<Arc<dyn KeyValueStore>>>>,
}

impl ClientInner {
    fn count(&self, which: usize, bytes: usize) {
        self.moved[which].fetch_add(bytes as u64, std::sync::atomic::Ordering::Relaxed);
    }
}

// SAFETY: a PJRT client is thread-safe (the C API's objects may be used from any
// thread); `raw` is only destroyed in `drop`, when no handle is left.
unsafe impl Send for ClientInner {}
// SAFETY: as above.
unsafe impl Sync for ClientInner {}

impl Drop for ClientInner {
    fn drop(&mut self) {
        let mut args = ClientDestroyArgs::new();
        args.client = self.raw;
        // An error destroying a client has nowhere to go; it is dropped.
        let _ = self.api.call(Slot::ClientDestroy, &mut args);
    }
}

/// A key-value store every process of a client that spans processes reads and
/// writes: how such a client (the GPU plugin's with `num_nodes` above 1) exchanges
/// its topology and its communicators' ids while it is created and while it
/// compiles. JAX's distributed runtime serves one over gRPC; meshwork's strategy
/// adapts the executor's MPI store to it. Errors are the store's words, which the
/// plugin reports.
pub trait KeyValueStore: Send + Sync {
    /// The value some process put under `key`, waiting at most `timeout` for it
    /// (`None`: without a limit); `Ok(None)` when none came in time.
    fn get(
        &self,
        key: &[u8],
        timeout: Option<std::time::Duration>,
    ) -> std::result::Result<Option<Vec<u8>>, String>;

    /// The value under `key` if some process has put it, without waiting.
    fn try_get(&self, key: &[u8]) -> std::result::Result<Option<Vec<u8>>, String>;

    /// Puts `value` under `key`, for every process.
    fn put(&self, key: &[u8], value: &[u8]) -> std::result::Result<(), String>;
}

/// `PJRT_CallbackError`: makes a plugin error from a code and a message.
type CallbackError =
    unsafe extern "C" fn(code: i32, message: *const c_char, size: usize) -> *mut Raw;

/// `PJRT_KeyValueGetCallback_Args` (the plugin's; `value` and its deleter are out).
#[repr(C)]
struct KvGetArgs {
    struct_size: usize,
    extension_start: *mut Raw,
    key: *const c_char,
    key_size: usize,
    timeout_in_ms: i32,
    callback_error: *const CallbackError,
    user_arg: *mut Raw,
    value: *mut c_char,
    value_size: usize,
    value_deleter_callback: Option<unsafe extern "C" fn(*mut c_char)>,
}

/// `PJRT_KeyValueTryGetCallback_Args`: as [`KvGetArgs`], without a timeout.
#[repr(C)]
struct KvTryGetArgs {
    struct_size: usize,
    extension_start: *mut Raw,
    key: *const c_char,
    key_size: usize,
    callback_error: *const CallbackError,
    user_arg: *mut Raw,
    value: *mut c_char,
    value_size: usize,
    value_deleter_callback: Option<unsafe extern "C" fn(*mut c_char)>,
}

/// `PJRT_KeyValuePutCallback_Args`.
#[repr(C)]
struct KvPutArgs {
    struct_size: usize,
    extension_start: *mut Raw,
    key: *const c_char,
    key_size: usize,
    value: *const c_char,
    value_size: usize,
    callback_error: *const CallbackError,
    user_arg: *mut Raw,
}

/// PJRT's error codes the callbacks report with.
const CODE_DEADLINE_EXCEEDED: i32 = 4;
const CODE_NOT_FOUND: i32 = 5;
const CODE_INTERNAL: i32 = 13;

/// The bytes at `data` (`size` of them; none when null).
///
/// # Safety
/// `data` is null or points at `size` readable bytes for the call.
unsafe fn bytes_at<'a>(data: *const c_char, size: usize) -> &'a [u8] {
    if data.is_null() || size == 0 {
        &[]
    } else {
        // SAFETY: as the caller promises.
        unsafe { std::slice::from_raw_parts(data.cast::<u8>(), size) }
    }
}

/// The plugin's error for a failed callback (null when it gave no way to make one).
///
/// # Safety
/// `make` is null or points at the plugin's live `PJRT_CallbackError`.
unsafe fn callback_error(make: *const CallbackError, code: i32, message: &str) -> *mut Raw {
    if make.is_null() {
        return ptr::null_mut();
    }
    // SAFETY: as the caller promises; the message lives for the call (the plugin
    // copies it).
    unsafe { (*make)(code, message.as_ptr().cast(), message.len()) }
}

/// A copy of `value` the plugin frees with [`free_value`]: its length in the 8 bytes
/// before it.
fn plugin_value(value: &[u8]) -> *mut c_char {
    let layout = value_layout(value.len());
    // SAFETY: the layout is at least 8 bytes (never zero-sized); a null return is
    // handled.
    let base = unsafe { std::alloc::alloc(layout) };
    if base.is_null() {
        std::alloc::handle_alloc_error(layout);
    }
    // SAFETY: `base` holds 8 + len bytes, 8-aligned.
    unsafe {
        base.cast::<usize>().write(value.len());
        ptr::copy_nonoverlapping(value.as_ptr(), base.add(8), value.len());
        base.add(8).cast()
    }
}

fn value_layout(len: usize) -> std::alloc::Layout {
    std::alloc::Layout::from_size_align(len.saturating_add(8), 8).expect("a value's layout")
}

/// `PJRT_KeyValueGetCallback_ValueDeleter` for the values [`plugin_value`] makes.
unsafe extern "C" fn free_value(value: *mut c_char) {
    if value.is_null() {
        return;
    }
    // SAFETY: `value` came from `plugin_value` and is freed once (the plugin calls
    // the deleter once per value): its length sits in the 8 bytes before it.
    unsafe {
        let base = value.cast::<u8>().sub(8);
        let len = base.cast::<usize>().read();
        std::alloc::dealloc(base, value_layout(len));
    }
}

/// The store behind a callback's `user_arg`.
///
/// # Safety
/// `user_arg` is the `Arc` a client made by `client_with_store` keeps boxed.
unsafe fn store_at<'a>(user_arg: *mut Raw) -> &'a Arc<dyn KeyValueStore> {
    // SAFETY: as the caller promises; the client (and so the box) outlives its
    // callbacks.
    unsafe { &*user_arg.cast::<Arc<dyn KeyValueStore>>() }
}

/// The outcome of a store call, a panic in it included.
fn guarded<T>(
    f: impl FnOnce() -> std::result::Result<T, String>,
) -> std::result::Result<T, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
        .unwrap_or_else(|_| Err("the key-value store panicked".into()))
}

/// `PJRT_KeyValueGetCallback`.
unsafe extern "C" fn kv_get(args: *mut KvGetArgs) -> *mut Raw {
    // SAFETY: the plugin passes its live args struct, `user_arg` being ours.
    let args = unsafe { &mut *args };
    // SAFETY: the key is `key_size` bytes of the plugin's for the call.
    let key = unsafe { bytes_at(args.key, args.key_size) };
    // A negative timeout is XLA's "infinite" squeezed into an `int`.
    let timeout = u64::try_from(args.timeout_in_ms).ok().map(std::time::Duration::from_millis);
    // SAFETY: `user_arg` is ours (set by `create_client`).
    let store = unsafe { store_at(args.user_arg) };
    let (code, message) = match guarded(|| store.get(key, timeout)) {
        Ok(Some(value)) => {
            args.value_size = value.len();
            args.value = plugin_value(&value);
            args.value_deleter_callback = Some(free_value);
            return ptr::null_mut();
        }
        Ok(None) => (
            CODE_DEADLINE_EXCEEDED,
            format!("no value under {:?} within {timeout:?}", String::from_utf8_lossy(key)),
        ),
        Err(message) => (CODE_INTERNAL, message),
    };
    // SAFETY: the plugin's error maker, live for the call.
    unsafe { callback_error(args.callback_error, code, &message) }
}

/// `PJRT_KeyValueTryGetCallback`.
unsafe extern "C" fn kv_try_get(args: *mut KvTryGetArgs) -> *mut Raw {
    // SAFETY: as `kv_get`.
    let args = unsafe { &mut *args };
    // SAFETY: as `kv_get`.
    let key = unsafe { bytes_at(args.key, args.key_size) };
    // SAFETY: as `kv_get`.
    let store = unsafe { store_at(args.user_arg) };
    let (code, message) = match guarded(|| store.try_get(key)) {
        Ok(Some(value)) => {
            args.value_size = value.len();
            args.value = plugin_value(&value);
            args.value_deleter_callback = Some(free_value);
            return ptr::null_mut();
        }
        Ok(None) => (CODE_NOT_FOUND, format!("no value under {:?}", String::from_utf8_lossy(key))),
        Err(message) => (CODE_INTERNAL, message),
    };
    // SAFETY: as `kv_get`.
    unsafe { callback_error(args.callback_error, code, &message) }
}

/// `PJRT_KeyValuePutCallback`.
unsafe extern "C" fn kv_put(args: *mut KvPutArgs) -> *mut Raw {
    // SAFETY: as `kv_get`.
    let args = unsafe { &mut *args };
    // SAFETY: the key and value are the plugin's for the call.
    let (key, value) =
        unsafe { (bytes_at(args.key, args.key_size), bytes_at(args.value, args.value_size)) };
    // SAFETY: as `kv_get`.
    let store = unsafe { store_at(args.user_arg) };
    match guarded(|| store.put(key, value)) {
        Ok(()) => ptr::null_mut(),
        // SAFETY: as `kv_get`.
        Err(message) => unsafe { callback_error(args.callback_error, CODE_INTERNAL, &message) },
    }
}

/// A device of a client (its addressable devices, in the plugin's order). Keeps its
/// client alive; the client's functions refuse another client's device.
#[derive(Clone)]
pub struct Device {
    client: Arc<ClientInner>,
    raw: *mut Raw,
    id: i32,
    kind: String,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Device({}, {})", self.id, self.kind)
    }
}

// SAFETY: a device pointer is an immutable handle owned by its client, which the
// `Device` keeps alive (`client`); it is only passed back to that client's functions
// (each checks the device is its own).
unsafe impl Send for Device {}
// SAFETY: as above.
unsafe impl Sync for Device {}

impl Device {
    /// The device's global id.
    pub fn id(&self) -> i32 {
        self.id
    }

    /// Its kind (`cpu`, `NVIDIA H100 80GB HBM3`, …).
    pub fn kind(&self) -> &str {
        &self.kind
    }
}

/// Memory of a device, as its allocator reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryStats {
    /// Bytes allocated now.
    pub bytes_in_use: i64,
    /// The allocator's limit, where it has one.
    pub bytes_limit: Option<i64>,
    /// The most bytes allocated at once so far, where the plugin keeps it (a GPU's
    /// allocator does).
    pub peak_bytes_in_use: Option<i64>,
}

/// Bytes a client's buffers moved ([`Client::transfers`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Transfers {
    /// Uploads ([`Client::put`]).
    pub host_to_device: u64,
    /// Downloads ([`Buffer::to_host`]).
    pub device_to_host: u64,
    /// Copies between devices ([`Buffer::copy_to`]).
    pub device_to_device: u64,
}

/// What moved between two readings (saturating at 0).
impl std::ops::Sub for Transfers {
    type Output = Transfers;
    fn sub(self, earlier: Transfers) -> Transfers {
        Transfers {
            host_to_device: self.host_to_device.saturating_sub(earlier.host_to_device),
            device_to_host: self.device_to_host.saturating_sub(earlier.device_to_host),
            device_to_device: self.device_to_device.saturating_sub(earlier.device_to_device),
        }
    }
}

/// A PJRT client: the devices of one plugin in this process.
pub struct Client {
    inner: Arc<ClientInner>,
    devices: Vec<Device>,
    platform: String,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Client({}, {} devices)", self.platform, self.devices.len())
    }
}

impl Client {
    /// The platform's name (`cpu`, `cuda`).
    pub fn platform(&self) -> &str {
        &self.platform
    }

    /// The bytes this client's buffers moved so far, counted as the copies are made
    /// (uploads, downloads, device-to-device copies).
    pub fn transfers(&self) -> Transfers {
        let read = |k: usize| self.inner.moved[k].load(std::sync::atomic::Ordering::Relaxed);
        Transfers { host_to_device: read(0), device_to_host: read(1), device_to_device: read(2) }
    }

    /// The addressable devices.
    pub fn devices(&self) -> &[Device] {
        &self.devices
    }

    /// Device `index` of [`devices`](Self::devices), or [`Error::NoDevice`].
    pub fn device(&self, index: usize) -> Result<&Device> {
        self.devices.get(index).ok_or(Error::NoDevice { index, count: self.devices.len() })
    }

    /// [`Error::Arguments`] unless `device` is this client's.
    fn own(&self, device: &Device) -> Result<()> {
        if Arc::ptr_eq(&device.client, &self.inner) {
            Ok(())
        } else {
            Err(Error::Arguments(format!("device {} belongs to another client", device.id)))
        }
    }

    /// The device's memory, where the plugin reports it (`None` where it does not, or
    /// for another client's device).
    pub fn memory_stats(&self, device: &Device) -> Option<MemoryStats> {
        self.own(device).ok()?;
        let mut args = DeviceMemoryStatsArgs::new();
        args.device = device.raw;
        self.inner.api.call(Slot::DeviceMemoryStats, &mut args).ok()?;
        Some(MemoryStats {
            bytes_in_use: args.bytes_in_use,
            bytes_limit: args.bytes_limit_is_set.then_some(args.bytes_limit),
            peak_bytes_in_use: args.peak_bytes_in_use_is_set.then_some(args.peak_bytes_in_use),
        })
    }

    /// Compiles a program: `code` in `format` (`"mlir"`: StableHLO, text or
    /// bytecode) with a serialized `CompileOptionsProto`.
    pub fn compile(&self, format: &str, code: &[u8], options: &[u8]) -> Result<Executable> {
        let program = ProgramArgs {
            struct_size: size_of::<ProgramArgs>(),
            extension_start: ptr::null_mut(),
            // The plugin only reads `code` when compiling (the field is in/out for
            // other calls); the cast to `*mut` is the C API's.
            code: code.as_ptr().cast_mut().cast(),
            code_size: code.len(),
            format: format.as_ptr().cast(),
            format_size: format.len(),
        };
        let mut args = ClientCompileArgs::new();
        args.client = self.inner.raw;
        args.program = &program;
        args.compile_options = options.as_ptr().cast();
        args.compile_options_size = options.len();
        self.inner.api.call(Slot::ClientCompile, &mut args)?;
        let loaded = args.executable;
        if loaded.is_null() {
            return Err(Error::Plugin {
                call: "PJRT_Client_Compile",
                code: Code::Internal,
                message: "reported success but returned no executable".into(),
            });
        }
        // Owned from here, so that an error below still destroys it.
        let mut executable =
            Executable { client: Arc::clone(&self.inner), raw: loaded, outputs: 0 };
        let mut get = LoadedGetExecutableArgs::new();
        get.loaded = loaded;
        self.inner.api.call(Slot::LoadedExecutableGetExecutable, &mut get)?;
        if get.executable.is_null() {
            return Err(Error::Plugin {
                call: "PJRT_LoadedExecutable_GetExecutable",
                code: Code::Internal,
                message: "reported success but returned no executable".into(),
            });
        }
        let mut outputs = ExecutableNumOutputsArgs::new();
        outputs.executable = get.executable;
        let counted = self.inner.api.call(Slot::ExecutableNumOutputs, &mut outputs);
        let mut destroy = ExecutableDestroyArgs::new();
        destroy.executable = get.executable;
        self.inner.api.call(Slot::ExecutableDestroy, &mut destroy)?;
        counted?;
        executable.outputs = outputs.num_outputs;
        Ok(executable)
    }

    /// Copies `tensor` to `device`. The copy is complete when this returns (the host
    /// memory may be reused at once).
    pub fn put(&self, tensor: &Tensor, device: &Device) -> Result<Buffer> {
        self.own(device)?;
        let bytes = tensor_bytes(tensor);
        let dims: Vec<i64> = tensor.shape().iter().map(|&d| d as i64).collect();
        let mut args = BufferFromHostArgs::new();
        args.client = self.inner.raw;
        args.data = bytes.as_ptr().cast();
        args.kind = buffer_type(tensor.dtype());
        args.dims = dims.as_ptr();
        args.num_dims = dims.len();
        args.semantics = IMMUTABLE_ONLY_DURING_CALL;
        args.device = device.raw;
        self.inner.api.call(Slot::ClientBufferFromHostBuffer, &mut args)?;
        // The host bytes are the plugin's until its event says done, buffer or not.
        let done = self
            .inner
            .api
            .await_event("PJRT_Client_BufferFromHostBuffer", args.done_with_host_buffer);
        if args.buffer.is_null() {
            return Err(Error::Plugin {
                call: "PJRT_Client_BufferFromHostBuffer",
                code: Code::Internal,
                message: "reported success but returned no buffer".into(),
            });
        }
        let buffer = Buffer { client: Arc::clone(&self.inner), raw: args.buffer };
        done?;
        self.inner.count(0, bytes.len());
        Ok(buffer)
    }
}

/// The tensor's row-major little-endian bytes, borrowed where it already is one.
fn tensor_bytes(tensor: &Tensor) -> std::borrow::Cow<'_, [u8]> {
    fn view<T: meshwork_types::Element>(s: &[T]) -> &[u8] {
        // SAFETY: the elements are plain numbers (`bool` is one byte, 0 or 1), so
        // their memory is `size_of_val(s)` initialized bytes; on a little-endian
        // target that is their little-endian encoding.
        unsafe { std::slice::from_raw_parts(s.as_ptr().cast::<u8>(), size_of_val(s)) }
    }
    if cfg!(target_endian = "little") {
        let borrowed = match tensor.dtype() {
            DType::F32 => tensor.as_slice::<f32>().map(view),
            DType::F64 => tensor.as_slice::<f64>().map(view),
            DType::I32 => tensor.as_slice::<i32>().map(view),
            DType::I64 => tensor.as_slice::<i64>().map(view),
            DType::Bool => tensor.as_slice::<bool>().map(view),
            _ => None,
        };
        if let Some(b) = borrowed {
            return std::borrow::Cow::Borrowed(b);
        }
    }
    std::borrow::Cow::Owned(tensor.to_le_bytes())
}

// ---------------------------------------------------------------------------------
// Buffers.
// ---------------------------------------------------------------------------------

/// An array on a device. Keeps its client alive.
pub struct Buffer {
    client: Arc<ClientInner>,
    raw: *mut Raw,
}

// SAFETY: PJRT buffers are thread-safe handles; `raw` is destroyed once, in `drop`.
unsafe impl Send for Buffer {}
// SAFETY: as above; `&Buffer` only queries it or copies it out.
unsafe impl Sync for Buffer {}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.dtype(), self.dims()) {
            (Ok(t), Ok(d)) => write!(f, "Buffer({}{d:?})", t.name()),
            _ => write!(f, "Buffer(?)"),
        }
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        let mut args = BufferDestroyArgs::new();
        args.buffer = self.raw;
        let _ = self.client.api.call(Slot::BufferDestroy, &mut args);
    }
}

impl Buffer {
    /// Its element type.
    pub fn dtype(&self) -> Result<DType> {
        let mut args = BufferElementTypeArgs::new();
        args.buffer = self.raw;
        self.client.api.call(Slot::BufferElementType, &mut args)?;
        dtype_of(args.kind).ok_or(Error::Plugin {
            call: "PJRT_Buffer_ElementType",
            code: Code::Unimplemented,
            message: format!("element type {} has no meshwork dtype", args.kind),
        })
    }

    /// Its dimensions.
    pub fn dims(&self) -> Result<Vec<usize>> {
        let mut args = BufferDimensionsArgs::new();
        args.buffer = self.raw;
        self.client.api.call(Slot::BufferDimensions, &mut args)?;
        if args.num_dims == 0 || args.dims.is_null() {
            return Ok(Vec::new());
        }
        // SAFETY: the buffer owns `num_dims` dims, alive while it is; copied out.
        let dims = unsafe { std::slice::from_raw_parts(args.dims, args.num_dims) };
        Ok(dims.iter().map(|&d| usize::try_from(d).unwrap_or(0)).collect())
    }

    /// The bytes it takes on its device.
    pub fn device_bytes(&self) -> Result<usize> {
        let mut args = BufferSizeArgs::new();
        args.buffer = self.raw;
        self.client.api.call(Slot::BufferOnDeviceSizeInBytes, &mut args)?;
        Ok(args.size)
    }

    /// Copies it to `device` of the same client, device to device (no host round
    /// trip where the plugin has a direct path). Returns when the copy is enqueued:
    /// the copy is ready when read, as an execution's outputs are.
    pub fn copy_to(&self, device: &Device) -> Result<Buffer> {
        if !Arc::ptr_eq(&device.client, &self.client) {
            return Err(Error::Arguments(format!(
                "a copy to device {}, which belongs to another client",
                device.id
            )));
        }
        let mut args = BufferCopyToDeviceArgs::new();
        args.buffer = self.raw;
        args.dst_device = device.raw;
        self.client.api.call(Slot::BufferCopyToDevice, &mut args)?;
        if args.dst_buffer.is_null() {
            return Err(Error::Plugin {
                call: "PJRT_Buffer_CopyToDevice",
                code: Code::Internal,
                message: "returned no buffer".into(),
            });
        }
        let copy = Buffer { client: Arc::clone(&self.client), raw: args.dst_buffer };
        self.client.count(2, self.logical_bytes()?);
        Ok(copy)
    }

    /// Its elements' bytes (dtype size times element count).
    fn logical_bytes(&self) -> Result<usize> {
        let (dtype, dims) = (self.dtype()?, self.dims()?);
        meshwork_types::Shape::new(&dims)
            .and_then(|s| s.byte_size(dtype))
            .map_err(|e| Error::Host(e.to_string()))
    }

    /// Copies it to the host (waiting for the computation that makes it).
    pub fn to_host(&self) -> Result<Tensor> {
        let (dtype, dims) = (self.dtype()?, self.dims()?);
        let want = meshwork_types::Shape::new(&dims)
            .and_then(|s| s.byte_size(dtype))
            .map_err(|e| Error::Host(e.to_string()))?;
        let mut size = BufferToHostArgs::new();
        size.src = self.raw;
        self.client.api.call(Slot::BufferToHostBuffer, &mut size)?;
        if size.dst_size != want {
            return Err(Error::Host(format!(
                "the device's copy is {} bytes, {}{dims:?} is {want}",
                size.dst_size,
                dtype.name()
            )));
        }
        let mut bytes = vec![0u8; want];
        let mut args = BufferToHostArgs::new();
        args.src = self.raw;
        args.dst = bytes.as_mut_ptr().cast();
        args.dst_size = bytes.len();
        self.client.api.call(Slot::BufferToHostBuffer, &mut args)?;
        // `bytes` must outlive the copy: the event is awaited before it is read.
        self.client.api.await_event("PJRT_Buffer_ToHostBuffer", args.event)?;
        self.client.count(1, want);
        Tensor::from_le_bytes(dtype, &dims, &bytes).map_err(|e| Error::Host(e.to_string()))
    }
}

// ---------------------------------------------------------------------------------
// Executables.
// ---------------------------------------------------------------------------------

/// An argument of an execution: a buffer that stays the caller's, or one given to the
/// execution (donated: the program may write its outputs into its memory).
#[derive(Debug)]
pub enum Arg<'a> {
    /// Read only; never donated, whatever the program's aliasing says.
    Borrowed(&'a Buffer),
    /// Given up; destroyed after the execution is enqueued.
    Donated(Buffer),
}

impl Arg<'_> {
    fn raw(&self) -> *mut Raw {
        match self {
            Arg::Borrowed(b) => b.raw,
            Arg::Donated(b) => b.raw,
        }
    }
}

/// A compiled program loaded on its client's devices. Keeps its client alive.
pub struct Executable {
    client: Arc<ClientInner>,
    raw: *mut Raw,
    outputs: usize,
}

// SAFETY: a loaded executable may be executed from any thread (PJRT); destroyed once.
unsafe impl Send for Executable {}
// SAFETY: as above.
unsafe impl Sync for Executable {}

impl std::fmt::Debug for Executable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Executable({} outputs)", self.outputs)
    }
}

impl Drop for Executable {
    fn drop(&mut self) {
        let mut args = LoadedDestroyArgs::new();
        args.executable = self.raw;
        let _ = self.client.api.call(Slot::LoadedExecutableDestroy, &mut args);
    }
}

impl Executable {
    /// The number of outputs per device.
    pub fn num_outputs(&self) -> usize {
        self.outputs
    }

    /// Enqueues the program on `args.len()` devices (`args[d]` are device `d`'s
    /// arguments, in the device assignment's order) and returns each device's
    /// outputs. Returns when the execution is enqueued: the outputs are ready when
    /// read ([`Buffer::to_host`] waits). Every argument list must have the same
    /// length, and each buffer must be on its device.
    pub fn execute(&self, args: Vec<Vec<Arg<'_>>>) -> Result<Vec<Vec<Buffer>>> {
        self.execute_with(args, None)
    }

    /// Enqueues a portable executable (compiled with
    /// [`CompileOptions::portable`](crate::options::CompileOptions::portable)) on
    /// `device`, any device of its client, and returns its outputs; otherwise as
    /// [`execute`](Self::execute). The plugin refuses an executable that is not
    /// portable, and arguments on another device.
    pub fn execute_on(&self, device: &Device, args: Vec<Arg<'_>>) -> Result<Vec<Buffer>> {
        if !Arc::ptr_eq(&device.client, &self.client) {
            return Err(Error::Arguments("the device belongs to another client".into()));
        }
        let mut out = self.execute_with(vec![args], Some(device))?;
        Ok(out.pop().unwrap_or_default())
    }

    fn execute_with(
        &self,
        args: Vec<Vec<Arg<'_>>>,
        device: Option<&Device>,
    ) -> Result<Vec<Vec<Buffer>>> {
        let devices = args.len();
        let num_args = args.first().map_or(0, Vec::len);
        if args.iter().any(|a| a.len() != num_args) {
            return Err(Error::Arguments("every device needs the same number of arguments".into()));
        }
        let foreign = args.iter().flatten().any(|a| {
            let b = match a {
                Arg::Borrowed(b) => *b,
                Arg::Donated(b) => b,
            };
            !Arc::ptr_eq(&b.client, &self.client)
        });
        if foreign {
            return Err(Error::Arguments("a buffer belongs to another client".into()));
        }
        let raw_args: Vec<Vec<*mut Raw>> =
            args.iter().map(|list| list.iter().map(Arg::raw).collect()).collect();
        let arg_ptrs: Vec<*const *mut Raw> = raw_args.iter().map(|l| l.as_ptr()).collect();
        let borrowed: Vec<i64> = (0..num_args)
            .filter(|&k| args.iter().any(|list| matches!(list[k], Arg::Borrowed(_))))
            .map(|k| k as i64)
            .collect();
        let mut outputs: Vec<Vec<*mut Raw>> =
            (0..devices).map(|_| vec![ptr::null_mut(); self.outputs]).collect();
        let out_ptrs: Vec<*mut *mut Raw> = outputs.iter_mut().map(|l| l.as_mut_ptr()).collect();
        let mut options = ExecuteOptions::new();
        options.non_donatable_input_indices = borrowed.as_ptr();
        options.num_non_donatable_input_indices = borrowed.len();
        let mut exec = ExecuteArgs::new();
        exec.executable = self.raw;
        exec.options = &mut options;
        exec.argument_lists = arg_ptrs.as_ptr();
        exec.num_devices = devices;
        exec.num_args = num_args;
        exec.output_lists = out_ptrs.as_ptr();
        // A device of this client (checked by `execute_on`), kept alive by `device`.
        exec.execute_device = device.map_or(ptr::null_mut(), |d| d.raw);
        self.client.api.call(Slot::LoadedExecutableExecute, &mut exec)?;
        // Donated arguments are dropped here (after the enqueue), borrowed ones stay.
        drop(args);
        // Every output is owned from here (a null one is an error after the others are
        // taken, so none leaks).
        let owned: Vec<Vec<Option<Buffer>>> = outputs
            .into_iter()
            .map(|list| {
                list.into_iter()
                    .map(|raw| {
                        (!raw.is_null()).then(|| Buffer { client: Arc::clone(&self.client), raw })
                    })
                    .collect()
            })
            .collect();
        owned
            .into_iter()
            .map(|list| {
                list.into_iter().collect::<Option<Vec<Buffer>>>().ok_or_else(|| Error::Plugin {
                    call: "PJRT_LoadedExecutable_Execute",
                    code: Code::Internal,
                    message: "an output buffer is missing".into(),
                })
            })
            .collect()
    }

    /// The program as XLA optimized it: its format (`hlo_with_config`: a serialized
    /// `HloModuleProtoWithConfig`) and bytes.
    pub fn optimized_program(&self) -> Result<(String, Vec<u8>)> {
        let api = &self.client.api;
        let mut get = LoadedGetExecutableArgs::new();
        get.loaded = self.raw;
        api.call(Slot::LoadedExecutableGetExecutable, &mut get)?;
        let program = optimized_program(api, get.executable);
        let mut destroy = ExecutableDestroyArgs::new();
        destroy.executable = get.executable;
        api.call(Slot::ExecutableDestroy, &mut destroy)?;
        program
    }
}

/// `PJRT_Executable_OptimizedProgram` of the (unloaded) executable `executable`.
fn optimized_program(api: &Api, executable: *mut Raw) -> Result<(String, Vec<u8>)> {
    let mut program = ProgramArgs::new();
    let mut args = ExecutableOptimizedProgramArgs::new();
    args.executable = executable;
    args.program = &mut program;
    // First call: the sizes; second: the bytes into memory of ours.
    api.call(Slot::ExecutableOptimizedProgram, &mut args)?;
    let mut code = vec![0u8; program.code_size];
    program.code = code.as_mut_ptr().cast();
    api.call(Slot::ExecutableOptimizedProgram, &mut args)?;
    let format = copy_str(program.format, program.format_size);
    code.truncate(program.code_size);
    Ok((format, code))
}

// ---------------------------------------------------------------------------------
// Compiling for a topology without its devices (ahead of time).
// ---------------------------------------------------------------------------------

/// A description of devices to compile for, made by the plugin without the devices
/// themselves (`PJRT_TopologyDescription_Create`): the CUDA plugin describes GPUs from
/// a target config on a machine with none. Keeps its plugin loaded.
pub struct Topology {
    api: Arc<Api>,
    raw: *mut Raw,
    devices: usize,
    kind: String,
}

// SAFETY: a topology description is immutable once made and PJRT's C API may be
// called from any thread; it is destroyed once, in `drop`.
unsafe impl Send for Topology {}
// SAFETY: as above; `&Topology` only reads it.
unsafe impl Sync for Topology {}

impl std::fmt::Debug for Topology {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Topology({} x {:?})", self.devices, self.kind)
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        let mut args = TopologyDestroyArgs::new();
        args.topology = self.raw;
        let _ = self.api.call(Slot::TopologyDestroy, &mut args);
    }
}

impl Plugin {
    /// A topology of the plugin's devices made from `options` alone, without the
    /// devices (the CUDA plugin reads `topology`, `"<slices>x<hosts>x<devices>"`, and
    /// `target_config`, a text `GpuTargetConfigProto`).
    ///
    /// The caller checks what the plugin does not: the CUDA plugin accepts an empty
    /// `target_config` here and then crashes in [`Topology::compile`].
    pub fn topology(&self, options: &[(&str, NamedValueOf)]) -> Result<Topology> {
        let named = named_values(options)?;
        let mut args = TopologyCreateArgs::new();
        args.create_options = named.as_ptr();
        args.num_options = named.len();
        self.api.call(Slot::TopologyCreate, &mut args)?;
        if args.topology.is_null() {
            return Err(Error::Plugin {
                call: "PJRT_TopologyDescription_Create",
                code: Code::Internal,
                message: "returned no topology".into(),
            });
        }
        let mut topology = Topology {
            api: Arc::clone(&self.api),
            raw: args.topology,
            devices: 0,
            kind: String::new(),
        };
        let mut d = TopologyDescriptionsArgs::new();
        d.topology = topology.raw;
        self.api.call(Slot::TopologyGetDeviceDescriptions, &mut d)?;
        topology.devices = d.num_descriptions;
        if !d.descriptions.is_null() && d.num_descriptions > 0 {
            // SAFETY: the topology owns an array of `num_descriptions` description
            // pointers that lives as long as it does; the first is read by value.
            let first = unsafe { ptr::read(d.descriptions) };
            let mut kind = DescriptionKindArgs::new();
            kind.description = first;
            self.api.call(Slot::DeviceDescriptionKind, &mut kind)?;
            topology.kind = copy_str(kind.kind, kind.kind_size);
        }
        Ok(topology)
    }
}

impl Topology {
    /// How many devices it describes.
    pub fn devices(&self) -> usize {
        self.devices
    }

    /// Their kind, as the plugin names it (`NVIDIA H100 80GB HBM3`).
    pub fn kind(&self) -> &str {
        &self.kind
    }

    /// Compiles `code` (of `format`, e.g. `mlir`) for this topology with the
    /// serialized `CompileOptionsProto` `options` (`PJRT_Compile` without a client):
    /// an executable to inspect, not to run.
    pub fn compile(&self, format: &str, code: &[u8], options: &[u8]) -> Result<Unloaded> {
        let mut program = ProgramArgs::new();
        // PJRT reads the code through a `char*` it does not write.
        program.code = code.as_ptr().cast_mut().cast();
        program.code_size = code.len();
        program.format = format.as_ptr().cast();
        program.format_size = format.len();
        let mut args = CompileArgs::new();
        args.topology = self.raw;
        args.program = &program;
        args.compile_options = options.as_ptr().cast();
        args.compile_options_size = options.len();
        self.api.call(Slot::Compile, &mut args)?;
        if args.executable.is_null() {
            return Err(Error::Plugin {
                call: "PJRT_Compile",
                code: Code::Internal,
                message: "returned no executable".into(),
            });
        }
        Ok(Unloaded { api: Arc::clone(&self.api), raw: args.executable })
    }
}

/// What XLA's buffer assignment gives one device's program
/// (`PJRT_Executable_GetCompiledMemoryStats`), in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CompiledMemory {
    /// The compiled code.
    pub generated_code: u64,
    /// The arguments.
    pub arguments: u64,
    /// The outputs.
    pub outputs: u64,
    /// The outputs that reuse (alias) an argument's buffer (donation).
    pub alias: u64,
    /// The temporaries.
    pub temp: u64,
    /// The most the program holds at once, as XLA computes it; 0 from a plugin that
    /// does not say.
    pub peak: u64,
}

/// A program compiled for a [`Topology`], not loaded on any device. Keeps its plugin
/// loaded.
pub struct Unloaded {
    api: Arc<Api>,
    raw: *mut Raw,
}

// SAFETY: an unloaded executable is immutable and PJRT's C API may be called from any
// thread; it is destroyed once, in `drop`.
unsafe impl Send for Unloaded {}
// SAFETY: as above.
unsafe impl Sync for Unloaded {}

impl std::fmt::Debug for Unloaded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Unloaded")
    }
}

impl Drop for Unloaded {
    fn drop(&mut self) {
        let mut args = ExecutableDestroyArgs::new();
        args.executable = self.raw;
        let _ = self.api.call(Slot::ExecutableDestroy, &mut args);
    }
}

impl Unloaded {
    /// Its compiled memory on one device.
    pub fn memory(&self) -> Result<CompiledMemory> {
        let mut args = CompiledMemoryStatsArgs::new();
        args.executable = self.raw;
        self.api.call(Slot::ExecutableGetCompiledMemoryStats, &mut args)?;
        let b = |v: i64| u64::try_from(v).unwrap_or(0);
        Ok(CompiledMemory {
            generated_code: b(args.generated_code_size_in_bytes),
            arguments: b(args.argument_size_in_bytes),
            outputs: b(args.output_size_in_bytes),
            alias: b(args.alias_size_in_bytes),
            temp: b(args.temp_size_in_bytes),
            peak: b(args.peak_memory_in_bytes),
        })
    }

    /// The program as XLA optimized it: its format (`hlo_with_config`) and bytes.
    pub fn optimized_program(&self) -> Result<(String, Vec<u8>)> {
        optimized_program(&self.api, self.raw)
    }
}

/// Loads each of `libs` with `RTLD_GLOBAL`, so that a plugin loaded afterwards finds
/// their symbols; a library whose dependencies are not loaded yet is retried after the
/// others, until a round loads nothing new. The libraries stay loaded for the
/// process's life, as the plugin that needs them does. Failures are left to the
/// plugin's own load, which names what it misses.
/// `path` as the user wrote it, for `dlopen`: a relative path (a bare name too) is the
/// working directory's file (`./name`), never one the loader's search path finds.
pub(crate) fn as_written(path: &Path) -> PathBuf {
    if path.is_relative() { Path::new(".").join(path) } else { path.to_path_buf() }
}

pub(crate) fn preload_global(libs: &[PathBuf]) {
    use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
    let mut pending: Vec<&PathBuf> = libs.iter().collect();
    loop {
        let before = pending.len();
        pending.retain(|path| {
            // SAFETY: the libraries are the CUDA runtime's, from the `nvidia-*` wheels
            // installed beside the plugin the user named; loading them runs their
            // initializers, as JAX's plugin loader does.
            match unsafe { Library::open(Some(path.as_path()), RTLD_NOW | RTLD_GLOBAL) } {
                Ok(lib) => {
                    std::mem::forget(lib);
                    false
                }
                Err(_) => true,
            }
        });
        if pending.is_empty() || pending.len() == before {
            return;
        }
    }
}
