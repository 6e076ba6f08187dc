"""Decoding: one call's loop -- the speculative round (loop.py) and the plain one, the session, the verification
tree, acceptance, the sampler, the cost model and gate, the learned state and the output sink. Imports proposers,
loading and runtime below it; the engine above hands it a Session, a drafter and the free sources."""
