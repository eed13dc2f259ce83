//! The library's error type.
use std::path::PathBuf;

/// Everything that can go wrong inside the edgerun library.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A weight, input or config file is malformed; names the file and the problem.
    #[error("{path}: {msg}")]
    BadFile {
        /// The offending file.
        path: PathBuf,
        /// What is wrong with it.
        msg: String,
    },
    /// A tensor inside a weight file is malformed or missing.
    #[error("{path}: tensor `{name}`: {msg}")]
    BadTensor {
        /// The file holding (or expected to hold) the tensor.
        path: PathBuf,
        /// The tensor name.
        name: String,
        /// What is wrong with it.
        msg: String,
    },
    /// A model configuration is invalid or unsupported.
    #[error("config: {0}")]
    Config(String),
    /// An input tensor or image does not fit the model.
    #[error("input: {0}")]
    Input(String),
    /// The requested device or dtype is not available in this build or on this machine.
    #[error("device: {0}")]
    Device(String),
    /// An I/O error on a named file.
    #[error("{path}: {source}")]
    Io {
        /// The file being read or written.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A device ran out of memory (CUDA's `CUDA_ERROR_OUT_OF_MEMORY`, cuBLAS's allocation failure,
    /// a Metal buffer): the batch that hit it may fit when smaller.
    #[error("{0}")]
    OutOfMemory(String),
    /// An error raised by a Candle op.
    #[error(transparent)]
    Candle(candle_core::Error),
}

/// Texts by which the devices' out-of-memory errors are recognised, whatever wraps them.
const OUT_OF_MEMORY: [&str; 4] = ["CUDA_ERROR_OUT_OF_MEMORY", "CUBLAS_STATUS_ALLOC_FAILED", "out of memory", "Out of memory"];

impl From<candle_core::Error> for Error {
    /// A Candle error, or [`Error::OutOfMemory`] where a device ran out of memory: the one place
    /// that tells them apart (Candle's device errors carry no type to match).
    fn from(e: candle_core::Error) -> Self {
        let text = Error::candle_message(&e);
        if OUT_OF_MEMORY.iter().any(|m| text.contains(m)) {
            Error::OutOfMemory(text)
        } else {
            Error::Candle(e)
        }
    }
}

/// The library's result type.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// A malformed-file error.
    pub fn bad_file(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Error::BadFile { path: path.into(), msg: msg.into() }
    }

    /// A malformed-tensor error.
    pub(crate) fn bad_tensor(path: impl Into<PathBuf>, name: impl Into<String>, msg: impl Into<String>) -> Self {
        Error::BadTensor { path: path.into(), name: name.into(), msg: msg.into() }
    }

    /// The message of a Candle error without the backtrace Candle attaches when `RUST_BACKTRACE` is set.
    pub fn candle_message(e: &candle_core::Error) -> String {
        match e {
            candle_core::Error::WithBacktrace { inner, .. } => Self::candle_message(inner),
            other => other.to_string(),
        }
    }

    /// An I/O error on `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), source }
    }
}
