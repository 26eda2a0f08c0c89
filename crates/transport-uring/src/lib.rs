//! Ferry's TCP wire protocol driven by io_uring, and file segments.
