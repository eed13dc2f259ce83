//! The batch setting (`--batch auto|N`, TOML `batch = "auto"`), the memory budget
//! (`--mem-budget MiB`, else what the device can spare) and the batch they allow.
use candle_core::Device;

use crate::memory::available;
use crate::memory::procfs::mib;
use crate::error::{Error, Result};

/// Largest batch accepted (`--batch N`) or planned (`auto`).
pub(crate) const MAX_BATCH: usize = 256;

/// What `--batch` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchSetting {
    /// Plan from the memory budget and the model's per-item estimate.
    Auto,
    /// At most this many items per forward pass.
    Fixed(usize),
}

impl BatchSetting {
    /// Parses `auto` or a count in 1..=[`MAX_BATCH`].
    pub fn parse(s: &str) -> std::result::Result<Self, String> {
        if s.trim().eq_ignore_ascii_case("auto") {
            return Ok(BatchSetting::Auto);
        }
        match s.trim().parse::<usize>() {
            Ok(n) if (1..=MAX_BATCH).contains(&n) => Ok(BatchSetting::Fixed(n)),
            _ => Err(format!("`{s}` is not `auto` or a batch size from 1 to {MAX_BATCH}")),
        }
    }
}

impl<'de> serde::Deserialize<'de> for BatchSetting {
    /// A TOML integer or the string `"auto"`.
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[derive(serde::Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Count(i64),
            Word(String),
        }
        match Raw::deserialize(d)? {
            Raw::Count(n) => Self::parse(&n.to_string()),
            Raw::Word(w) => Self::parse(&w),
        }
        .map_err(serde::de::Error::custom)
    }
}

impl serde::Serialize for BatchSetting {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        match self {
            BatchSetting::Auto => s.serialize_str("auto"),
            BatchSetting::Fixed(n) => s.serialize_u64(*n as u64),
        }
    }
}

impl std::str::FromStr for BatchSetting {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        Self::parse(s)
    }
}

/// Largest `--mem-budget` accepted, MiB (16 TiB).
pub(crate) const MAX_BUDGET_MIB: u64 = 16 << 20;

/// The environment variable of the planner's test hook: under `auto`, plan this many items per
/// pass whatever the budget says (to test what a plan too large for the memory does).
pub(crate) const FORCE_PLAN_ENV: &str = "EDGERUN_PLAN_BATCH";

/// The forced plan of the test hook, when set to a batch from 1 to [`MAX_BATCH`].
pub(crate) fn forced_plan() -> Option<usize> {
    static FORCED: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *FORCED.get_or_init(|| std::env::var(FORCE_PLAN_ENV).ok().and_then(|v| v.trim().parse().ok()).filter(|n| (1..=MAX_BATCH).contains(n)))
}

/// Bytes activations may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryBudget {
    /// The budget in bytes.
    pub bytes: u64,
}

impl MemoryBudget {
    /// The budget when the device cannot tell what it can spare: 1 GiB.
    pub const FALLBACK: MemoryBudget = MemoryBudget { bytes: 1 << 30 };

    /// `--mem-budget` (MiB) when given; else what `device` can spare now (call it after the model is
    /// loaded, so the weights are already accounted for) less a safety margin of 10 % (at least
    /// 256 MiB); 1 GiB when the device cannot tell.
    pub fn resolve(flag_mib: Option<u64>, device: &Device) -> Result<Self> {
        Ok(Self::explain(flag_mib, device)?.0)
    }

    /// [`MemoryBudget::resolve`] and where the budget came from, in words (for the run's log and
    /// `edgerun doctor`).
    pub fn explain(flag_mib: Option<u64>, device: &Device) -> Result<(Self, String)> {
        if let Some(m) = flag_mib {
            if m == 0 || m > MAX_BUDGET_MIB {
                return Err(Error::Input(format!("--mem-budget {m}: expected 1 to {MAX_BUDGET_MIB} MiB")));
            }
            return Ok((MemoryBudget { bytes: m << 20 }, format!("{m} MiB, set by --mem-budget")));
        }
        let Some(a) = available(device) else {
            return Ok((Self::FALLBACK, format!("{} (the device cannot tell what it can spare)", mib(Self::FALLBACK.bytes))));
        };
        let b = Self::with_margin(a.bytes);
        Ok((b, format!("{}: {} spare less the margin, from {}", mib(b.bytes), mib(a.bytes), a.source)))
    }

    /// The budget for `avail` spare bytes: less 10 % (at least 256 MiB), at least 64 MiB.
    pub(crate) fn with_margin(avail: u64) -> Self {
        let margin = (avail / 10).max(256 << 20);
        MemoryBudget { bytes: avail.saturating_sub(margin).max(64 << 20) }
    }

    /// The batch `setting` allows with `per_item` bytes of activations per item.
    pub(crate) fn batch_for(&self, setting: BatchSetting, per_item: u64) -> usize {
        match setting {
            BatchSetting::Fixed(n) => n,
            BatchSetting::Auto => usize::try_from(self.bytes / per_item.max(1)).unwrap_or(MAX_BATCH).clamp(1, MAX_BATCH),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_setting_parses_auto_and_bounded_counts() {
        assert_eq!(BatchSetting::parse("auto"), Ok(BatchSetting::Auto));
        assert_eq!(BatchSetting::parse("4"), Ok(BatchSetting::Fixed(4)));
        assert!(BatchSetting::parse("0").is_err());
        assert!(BatchSetting::parse("100000").is_err());
        assert!(BatchSetting::parse("-1").is_err());
    }

    #[test]
    fn the_budget_divides_into_items() {
        let b = MemoryBudget { bytes: 1000 << 20 };
        assert_eq!(b.batch_for(BatchSetting::Auto, 300 << 20), 3);
        assert_eq!(b.batch_for(BatchSetting::Auto, 2000 << 20), 1);
        assert_eq!(b.batch_for(BatchSetting::Auto, 1), MAX_BATCH);
        assert_eq!(b.batch_for(BatchSetting::Fixed(7), 2000 << 20), 7);
        assert!(MemoryBudget::resolve(Some(0), &Device::Cpu).is_err());
        assert_eq!(MemoryBudget::resolve(Some(512), &Device::Cpu).unwrap().bytes, 512 << 20);
        let (b, why) = MemoryBudget::explain(None, &Device::Cpu).unwrap();
        assert!(b.bytes >= 64 << 20 && why.contains("spare less the margin, from"), "{why}");
        assert_eq!(MemoryBudget::with_margin(700 << 20).bytes, 444 << 20);
        assert_eq!(MemoryBudget::with_margin(10 << 30).bytes, (10u64 << 30) - (1 << 30));
        assert_eq!(MemoryBudget::with_margin(100 << 20).bytes, 64 << 20);
    }
}
