//! Sharding: `--shard K/N` splits the sorted input list into batches (`batch` consecutive items) and
//! gives batch `c` to shard `c mod N`. Shards therefore run exactly the forward passes an unsharded run
//! would, and their outputs are bit-identical to it.
use crate::error::{Error, Result};

/// One shard of `count` (0-based `index`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    /// This shard, `0..count`.
    pub index: usize,
    /// The number of shards.
    pub count: usize,
}

impl Default for Shard {
    fn default() -> Self {
        Shard { index: 0, count: 1 }
    }
}

impl Shard {
    /// A checked shard.
    pub fn new(index: usize, count: usize) -> Result<Self> {
        if count == 0 || index >= count {
            return Err(Error::Config(format!("shard {index}/{count}: expected 0 ≤ K < N")));
        }
        Ok(Shard { index, count })
    }

    /// Parses `K/N` (0-based K).
    pub fn parse(s: &str) -> Result<Self> {
        let bad = || Error::Config(format!("--shard `{s}` is not K/N (0-based K, e.g. 0/4)"));
        let (k, n) = s.split_once('/').ok_or_else(bad)?;
        let k = k.trim().parse::<usize>().map_err(|_| bad())?;
        let n = n.trim().parse::<usize>().map_err(|_| bad())?;
        Self::new(k, n)
    }

    /// The shard from the environment: a SLURM job array (`SLURM_ARRAY_TASK_ID`, `_MIN`, `_STEP`,
    /// `_COUNT`) or a Kubernetes Indexed Job (`JOB_COMPLETION_INDEX`, with `count` from `--shard-count`).
    pub fn from_env(count: Option<usize>) -> Result<Option<Self>> {
        Self::from_vars(|k| std::env::var(k).ok(), count)
    }

    /// [`Shard::from_env`] over any variable lookup.
    pub(crate) fn from_vars(var: impl Fn(&str) -> Option<String>, count: Option<usize>) -> Result<Option<Self>> {
        let num = |k: &str| -> Result<Option<usize>> {
            match var(k) {
                None => Ok(None),
                Some(v) if v.trim().is_empty() => Ok(None),
                Some(v) => v.trim().parse::<usize>().map(Some).map_err(|_| Error::Config(format!("{k}=`{v}` is not a number"))),
            }
        };
        if let Some(id) = num("SLURM_ARRAY_TASK_ID")? {
            let min = num("SLURM_ARRAY_TASK_MIN")?.unwrap_or(0);
            let step = num("SLURM_ARRAY_TASK_STEP")?.unwrap_or(1).max(1);
            let n = match count {
                Some(n) => n,
                None => num("SLURM_ARRAY_TASK_COUNT")?
                    .ok_or_else(|| Error::Config("SLURM_ARRAY_TASK_ID is set but SLURM_ARRAY_TASK_COUNT is not; pass --shard-count".into()))?,
            };
            let k = id.checked_sub(min).ok_or_else(|| Error::Config(format!("SLURM_ARRAY_TASK_ID {id} < SLURM_ARRAY_TASK_MIN {min}")))? / step;
            return Self::new(k, n).map(Some);
        }
        if let Some(k) = num("JOB_COMPLETION_INDEX")? {
            let n = count.ok_or_else(|| {
                Error::Config("JOB_COMPLETION_INDEX is set (Kubernetes Indexed Job): pass --shard-count with the job's completions".into())
            })?;
            return Self::new(k, n).map(Some);
        }
        Ok(None)
    }

    /// Whether this shard runs batch `chunk`.
    pub(crate) fn owns_chunk(&self, chunk: usize) -> bool {
        chunk % self.count == self.index
    }

    /// Whether this is the only shard.
    pub(crate) fn is_whole(&self) -> bool {
        self.count == 1
    }

    /// File-name tag: `""` unsharded, else `.shard-07-of-100` (K zero-padded to the width of N − 1).
    pub fn tag(&self) -> String {
        if self.is_whole() {
            String::new()
        } else {
            let w = (self.count - 1).to_string().len();
            format!(".shard-{:0w$}-of-{}", self.index, self.count)
        }
    }
}

impl std::fmt::Display for Shard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.index, self.count)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(kv: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| kv.iter().find(|(a, _)| *a == k).map(|(_, v)| v.to_string())
    }

    #[test]
    fn parses_flags_and_environments() {
        assert_eq!(Shard::parse("2/3").unwrap(), Shard { index: 2, count: 3 });
        assert!(Shard::parse("3/3").is_err() && Shard::parse("x").is_err() && Shard::parse("0/0").is_err());
        let s = Shard::from_vars(env(&[("SLURM_ARRAY_TASK_ID", "5"), ("SLURM_ARRAY_TASK_MIN", "1"), ("SLURM_ARRAY_TASK_COUNT", "8")]), None);
        assert_eq!(s.unwrap(), Some(Shard { index: 4, count: 8 }));
        assert_eq!(Shard::from_vars(env(&[("JOB_COMPLETION_INDEX", "3")]), Some(4)).unwrap(), Some(Shard { index: 3, count: 4 }));
        assert!(Shard::from_vars(env(&[("JOB_COMPLETION_INDEX", "3")]), None).is_err());
        assert_eq!(Shard::from_vars(env(&[]), None).unwrap(), None);
        assert_eq!(Shard { index: 7, count: 100 }.tag(), ".shard-07-of-100");
    }
}
