"""Decoding: the round of every call (loop.py; the reference method's is a plain step), the batch that drives the
rounds (batch.py), the session, the verification tree, the gate, the learned state and the output sink. Imports
proposers, target, loading, sample and runtime below it (acceptance and the sampler are sample/'s); the engine above
hands it a Session, a drafter and the free sources."""
