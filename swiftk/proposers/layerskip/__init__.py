"""The layer-skip drafter (SWIFT, Self-SD, early exit): the proposer (draft.py) and the on-the-fly skip-set search
(search.py). The offline search of `swiftk optimize` is an application of the engine: swiftk/skipset_search.py."""
