"""Loading: model files into runtime objects -- GGUF reading, the checkpoint loaders, the tokenizer and the model
registry (download and cache). Imports the runtime below it, nothing above."""
