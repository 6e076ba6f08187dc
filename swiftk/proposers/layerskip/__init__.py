"""The layer-skip drafter (SWIFT, Self-SD, early exit): the proposer (draft.py), the on-the-fly skip-set search
(search.py) and the offline search of `swiftk optimize` (offline.py)."""
