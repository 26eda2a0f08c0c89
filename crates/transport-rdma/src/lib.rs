//! RC queue pairs over verbs for Ferry: one-sided READ/WRITE, multi-rail striping.
