//! kspeed's log records delivered to a C callback.

use std::ffi::{c_char, c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Mutex;

use super::errors::{guard, ksp_status, Fail};

/// Receives kspeed's log records: `level` 1 error, 2 warn, 3 info, 4 debug,
/// 5 trace; `target` the module; `message` the text. Both strings are valid
/// only during the call. Called from kspeed's threads, concurrently.
///
/// The callback must return normally: it must not throw a C++ exception,
/// `longjmp` or otherwise unwind out of itself (catch everything inside
/// it). It is called through a plain C function pointer from kspeed's
/// threads, where an unwinding foreign exception is undefined behaviour
/// (in practice the process aborts).
pub type ksp_log_callback = Option<
    unsafe extern "C" fn(
        userdata: *mut c_void,
        level: c_int,
        target: *const c_char,
        message: *const c_char,
    ),
>;

struct CallbackLogger;

struct Sink {
    cb: ksp_log_callback,
    userdata: usize,
    max: log::LevelFilter,
}

static SINK: Mutex<Sink> = Mutex::new(Sink {
    cb: None,
    userdata: 0,
    max: log::LevelFilter::Off,
});

impl log::Log for CallbackLogger {
    fn enabled(&self, m: &log::Metadata<'_>) -> bool {
        m.level() <= SINK.lock().map(|s| s.max).unwrap_or(log::LevelFilter::Off)
    }

    fn log(&self, r: &log::Record<'_>) {
        let (cb, ud) = match SINK.lock() {
            Ok(s) if r.level() <= s.max => (s.cb, s.userdata),
            _ => return,
        };
        let Some(cb) = cb else { return };
        let target = std::ffi::CString::new(r.target().replace('\0', " ")).unwrap_or_default();
        let msg =
            std::ffi::CString::new(r.args().to_string().replace('\0', " ")).unwrap_or_default();
        // SAFETY: the host registered this function for exactly this call
        // shape; the strings live until it returns. It must not unwind
        // (documented on ksp_log_callback); catch_unwind only contains a
        // Rust panic raised while formatting around the call.
        let _ = catch_unwind(AssertUnwindSafe(|| unsafe {
            cb(
                ud as *mut c_void,
                r.level() as c_int,
                target.as_ptr(),
                msg.as_ptr(),
            )
        }));
    }

    fn flush(&self) {}
}

static LOGGER: CallbackLogger = CallbackLogger;

/// Sends kspeed's log records at `max_level` (1 error … 5 trace; 0 off) and
/// above to `cb` with `userdata`. Replaces any earlier callback; NULL `cb`
/// stops delivery. Fails with `KSP_ERR_STATE` if the process already has
/// another Rust logger installed.
///
/// Status: `KSP_OK`; `KSP_ERR_INVALID_ARG` (level); `KSP_ERR_STATE`.
///
/// Thread safety: any thread; the setting is process-wide and replaces the
/// callback for every loader and service (records already being delivered
/// on kspeed's threads may still reach the old one).
///
/// # Safety
/// `cb` must be callable from any thread until replaced; `userdata` is
/// passed through untouched.
#[no_mangle]
pub unsafe extern "C" fn ksp_set_log_callback(
    cb: ksp_log_callback,
    userdata: *mut c_void,
    max_level: c_int,
) -> ksp_status {
    guard(|| {
        let max = match max_level {
            0 => log::LevelFilter::Off,
            1 => log::LevelFilter::Error,
            2 => log::LevelFilter::Warn,
            3 => log::LevelFilter::Info,
            4 => log::LevelFilter::Debug,
            5 => log::LevelFilter::Trace,
            x => return Err(Fail::Invalid(format!("log level {x} is not 0..5"))),
        };
        {
            let mut s = SINK
                .lock()
                .map_err(|_| Fail::State("log sink poisoned".into()))?;
            s.cb = cb;
            s.userdata = userdata as usize;
            s.max = if cb.is_some() {
                max
            } else {
                log::LevelFilter::Off
            };
        }
        static INSTALLED: std::sync::Once = std::sync::Once::new();
        let mut result = Ok(());
        INSTALLED.call_once(|| {
            result = log::set_logger(&LOGGER).map_err(|_| {
                Fail::State("another logger is already installed in this process".into())
            });
        });
        result?;
        log::set_max_level(max);
        Ok(())
    })
}
