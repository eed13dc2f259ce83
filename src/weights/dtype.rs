//! Storage dtypes of tensors in weight files, and their mapping onto Candle types.
use candle_core::quantized::GgmlDType;
use candle_core::DType;

/// How a tensor's elements are stored in a weight file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoredDType {
    /// A plain element type that Candle can hold directly.
    Plain(DType),
    /// A GGML block-quantized type (also F32/F16/BF16 when read from GGUF).
    Ggml(GgmlDType),
}

impl StoredDType {
    /// Parses a safetensors dtype string (`"F32"`, `"BF16"`, ...).
    pub(crate) fn from_safetensors(s: &str) -> Option<Self> {
        let d = match s {
            "F64" => DType::F64,
            "F32" => DType::F32,
            "F16" => DType::F16,
            "BF16" => DType::BF16,
            "I64" => DType::I64,
            "I32" => DType::I32,
            "I16" => DType::I16,
            "U32" => DType::U32,
            "U8" | "BOOL" => DType::U8,
            _ => return None,
        };
        Some(StoredDType::Plain(d))
    }

    /// Parses a GGML type id as stored in a GGUF tensor info.
    pub(crate) fn from_ggml_id(id: u32) -> Option<Self> {
        let t = match id {
            0 => GgmlDType::F32,
            1 => GgmlDType::F16,
            2 => GgmlDType::Q4_0,
            3 => GgmlDType::Q4_1,
            6 => GgmlDType::Q5_0,
            7 => GgmlDType::Q5_1,
            8 => GgmlDType::Q8_0,
            9 => GgmlDType::Q8_1,
            10 => GgmlDType::Q2K,
            11 => GgmlDType::Q3K,
            12 => GgmlDType::Q4K,
            13 => GgmlDType::Q5K,
            14 => GgmlDType::Q6K,
            15 => GgmlDType::Q8K,
            30 => GgmlDType::BF16,
            _ => return None,
        };
        Some(StoredDType::Ggml(t))
    }

    /// Number of bytes `numel` elements occupy, or None when `numel` is not a whole number of blocks
    /// or the size overflows.
    pub fn bytes_for(&self, numel: usize) -> Option<usize> {
        match self {
            StoredDType::Plain(d) => numel.checked_mul(d.size_in_bytes()),
            StoredDType::Ggml(g) => {
                let bs = g.block_size();
                if !numel.is_multiple_of(bs) {
                    return None;
                }
                (numel / bs).checked_mul(g.type_size())
            }
        }
    }

    /// Whether the type is block-quantized (as opposed to a plain float or integer layout).
    pub fn is_quantized(&self) -> bool {
        matches!(self, StoredDType::Ggml(g) if !matches!(g, GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16))
    }

    /// The Candle dtype of the stored data when it is a plain layout.
    pub fn plain(&self) -> Option<DType> {
        match self {
            StoredDType::Plain(d) => Some(*d),
            StoredDType::Ggml(GgmlDType::F32) => Some(DType::F32),
            StoredDType::Ggml(GgmlDType::F16) => Some(DType::F16),
            StoredDType::Ggml(GgmlDType::BF16) => Some(DType::BF16),
            StoredDType::Ggml(_) => None,
        }
    }

    /// A short human name (`f32`, `q4k`, ...).
    pub fn name(&self) -> String {
        match self {
            StoredDType::Plain(d) => d.as_str().to_string(),
            StoredDType::Ggml(g) => ggml_name(*g).to_string(),
        }
    }
}

/// The GGML type id written into GGUF tensor infos.
pub(crate) fn ggml_id(t: GgmlDType) -> u32 {
    match t {
        GgmlDType::F32 => 0,
        GgmlDType::F16 => 1,
        GgmlDType::Q4_0 => 2,
        GgmlDType::Q4_1 => 3,
        GgmlDType::Q5_0 => 6,
        GgmlDType::Q5_1 => 7,
        GgmlDType::Q8_0 => 8,
        GgmlDType::Q8_1 => 9,
        GgmlDType::Q2K => 10,
        GgmlDType::Q3K => 11,
        GgmlDType::Q4K => 12,
        GgmlDType::Q5K => 13,
        GgmlDType::Q6K => 14,
        GgmlDType::Q8K => 15,
        GgmlDType::BF16 => 30,
    }
}

/// The lower-case name edgerun uses for a GGML type on the command line and in recipes.
pub fn ggml_name(t: GgmlDType) -> &'static str {
    match t {
        GgmlDType::F32 => "f32",
        GgmlDType::F16 => "f16",
        GgmlDType::BF16 => "bf16",
        GgmlDType::Q4_0 => "q4_0",
        GgmlDType::Q4_1 => "q4_1",
        GgmlDType::Q5_0 => "q5_0",
        GgmlDType::Q5_1 => "q5_1",
        GgmlDType::Q8_0 => "q8_0",
        GgmlDType::Q8_1 => "q8_1",
        GgmlDType::Q2K => "q2k",
        GgmlDType::Q3K => "q3k",
        GgmlDType::Q4K => "q4k",
        GgmlDType::Q5K => "q5k",
        GgmlDType::Q6K => "q6k",
        GgmlDType::Q8K => "q8k",
    }
}

/// Parses a GGML type name as accepted by `edgerun quantize --type` and recipes.
pub fn parse_ggml_name(s: &str) -> Option<GgmlDType> {
    let t = match s.to_ascii_lowercase().replace('-', "_").as_str() {
        "f32" => GgmlDType::F32,
        "f16" => GgmlDType::F16,
        "bf16" => GgmlDType::BF16,
        "q4_0" => GgmlDType::Q4_0,
        "q4_1" => GgmlDType::Q4_1,
        "q5_0" => GgmlDType::Q5_0,
        "q5_1" => GgmlDType::Q5_1,
        "q8_0" => GgmlDType::Q8_0,
        "q2k" | "q2_k" => GgmlDType::Q2K,
        "q3k" | "q3_k" => GgmlDType::Q3K,
        "q4k" | "q4_k" => GgmlDType::Q4K,
        "q5k" | "q5_k" => GgmlDType::Q5K,
        "q6k" | "q6_k" => GgmlDType::Q6K,
        _ => return None,
    };
    Some(t)
}
