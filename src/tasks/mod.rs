//! The tasks: what the commands, `annotate`'s model stages and fine-tuning do with a model — the
//! image → network input → output map around the raw models, and [`Task`], the one list of them.
pub mod batch;
pub mod chm;
pub mod depth;
pub mod open_vocab;
pub mod segment;
pub mod tiles;

/// A task a model family serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Task {
    /// Monocular depth (`edgerun depth`, annotate's `depth` stage, fine-tuning `task = "depth"`).
    Depth,
    /// Semantic segmentation into a class map (`segment`, `segmentation`).
    Segmentation,
    /// Canopy height in metres (`chm`).
    CanopyHeight,
    /// Physics events of particles (`lgatr`).
    Events,
}

impl Task {
    /// Every task.
    pub const ALL: [Task; 4] = [Task::Depth, Task::Segmentation, Task::CanopyHeight, Task::Events];

    /// Its name in configs and messages.
    pub fn name(self) -> &'static str {
        match self {
            Task::Depth => "depth",
            Task::Segmentation => "segmentation",
            Task::CanopyHeight => "chm",
            Task::Events => "events",
        }
    }

    /// Parses a task name or one of its aliases (`seg`, `segment`; `canopy`, `canopy_height`).
    pub fn parse(s: &str) -> Option<Task> {
        match s {
            "depth" => Some(Task::Depth),
            "segmentation" | "seg" | "segment" => Some(Task::Segmentation),
            "chm" | "canopy" | "canopy_height" => Some(Task::CanopyHeight),
            "events" => Some(Task::Events),
            _ => None,
        }
    }

}

impl std::str::FromStr for Task {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        Task::parse(s).ok_or_else(|| format!("`{s}` is not a task (expected {})", Task::ALL.map(Task::name).join(", ")))
    }
}

impl<'de> serde::Deserialize<'de> for Task {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        String::deserialize(d)?.parse().map_err(serde::de::Error::custom)
    }
}

impl serde::Serialize for Task {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}
