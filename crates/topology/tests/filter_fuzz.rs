//! Fuzzes the `NCCL_IB_HCA` parser: it never panics, and every filter it prints reads back equal.

use ferry_topology::{HcaEntry, HcaFilter, Selector, TopologyError};
use proptest::prelude::*;

fn entry() -> impl Strategy<Value = HcaEntry> {
    ("[a-z][a-z0-9_.-]{0,10}", prop::option::of(1u32..300))
        .prop_map(|(name, port)| HcaEntry { name, port })
}

fn filter() -> impl Strategy<Value = HcaFilter> {
    (
        any::<bool>(),
        any::<bool>(),
        prop::collection::vec(entry(), 1..6),
    )
        .prop_map(|(exclude, exact, entries)| HcaFilter {
            exclude,
            exact,
            entries,
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(
        std::env::var("FERRY_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(2000)
    ))]

    #[test]
    fn never_panics_on_any_string(s in any::<String>()) {
        let _ = HcaFilter::parse(&s);
        let _ = Selector::from_hca(&s);
    }

    #[test]
    fn never_panics_on_filter_like_strings(s in "[\\^=,:_a-z0-9 \\t.-]{0,40}") {
        match HcaFilter::parse(&s) {
            Ok(f) => {
                // Whatever parses prints a canonical form that parses back equal.
                let again = HcaFilter::parse(&f.to_string()).unwrap();
                prop_assert_eq!(again, f);
            }
            Err(TopologyError::ParseFilter { input, token, .. }) => {
                prop_assert_eq!(&input, &s);
                prop_assert!(s.contains(token.as_str()), "token {:?} not in {:?}", token, s);
            }
            Err(other) => prop_assert!(false, "unexpected error {other}"),
        }
    }

    #[test]
    fn round_trips(f in filter()) {
        let text = f.to_string();
        prop_assert_eq!(HcaFilter::parse(&text).unwrap(), f);
    }

    #[test]
    fn matching_never_panics(f in filter(), dev in "[a-z0-9_]{0,12}", port in 0u32..5) {
        let _ = f.allows_device(&dev);
        let _ = f.allows_port(&dev, port);
    }
}
