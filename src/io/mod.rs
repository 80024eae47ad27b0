//! Loading and saving safely: what the user names is opened as a regular file only, models are
//! memory-mapped read-only and decoded without copying weights, outputs are written atomically
//! through registered temporaries, and input-controlled sizes are capped before they allocate.

pub mod external_payloads;
pub mod fsio;
pub mod limits;
pub mod model_io;
pub mod prescan;
pub mod progress;
pub mod temp;
pub mod unnamed;
