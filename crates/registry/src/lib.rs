//! Registration lifecycle, per-context fan-out and budgets for Ferry.
