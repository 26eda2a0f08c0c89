//! libibverbs FFI for Ferry: checked-in bindgen output, a runtime loader that never panics, and ports of the static-inline verbs.
