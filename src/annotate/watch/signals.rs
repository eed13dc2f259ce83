//! SIGTERM and SIGINT under `--watch`: the first asks the run to stop after the batch in flight
//! (journal and status written, exit 0); a second one ends the process at once with status 130
//! (every record already journalled stays valid: records follow durable outputs).
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::flag;

use crate::error::{Error, Result};

/// Exit status of a second signal.
pub(crate) const EXIT_AT_ONCE: i32 = 130;

/// Whether a stop was asked for.
pub(crate) struct Stop(Arc<AtomicBool>);

impl Stop {
    /// Installs the handlers.
    pub(crate) fn install() -> Result<Stop> {
        let asked = Arc::new(AtomicBool::new(false));
        for sig in [SIGTERM, SIGINT] {
            // The conditional exit comes first: it fires only once the flag is already set.
            flag::register_conditional_shutdown(sig, EXIT_AT_ONCE, asked.clone()).map_err(|e| Error::Config(format!("cannot handle signal {sig}: {e}")))?;
            flag::register(sig, asked.clone()).map_err(|e| Error::Config(format!("cannot handle signal {sig}: {e}")))?;
        }
        Ok(Stop(asked))
    }

    /// Whether a signal asked the run to stop.
    pub(crate) fn asked(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}
