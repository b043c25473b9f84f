"""Pure compute on torch tensors: norms, rotary embeddings, attention, activations, linear layers.
Each kernel sits next to a plain reference implementation it is tested against. Imports torch only."""
