"""Mixture of Attentions (MoA) drafter: a small trained draft model on the target's own KV cache.

model.py  the drafter module (LSA, SA, CA, TLI) and its safetensors file format
runner.py its incremental state beside the target's cache, and the draft loop
method.py method="moa": registered with swiftk.methods, the drafter behind the round's model-drafter protocol
data.py   the training corpus and feature extraction (target K/V and activations cached as safetensors)
train.py  the training loop (`swiftk train-drafter`): forward KL + Smooth-L1, resumable checkpoints
"""
