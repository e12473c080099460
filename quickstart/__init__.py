"""The quickstart (``astrai quickstart``, the README's ``make run``): train a small chat model on CPU in minutes.

The flow, end to end, with no downloads:
1. ``task``: generate the bundled synthetic chat task deterministically (2-digit addition, "What is 47 + 85?"
   -> "132", plus optional string tasks) and split it into training problems and held-out problems that never
   appear in training; write the training set as ``{"messages": [...]}`` JSONL for SFT.
2. ``vocab``: build the 100-token character-level tokenizer with the ChatML chat template (eos ``<|im_end|>``).
3. training (``astrai.train``): SFT a ~5-20M-parameter decoder on the rendered chats.
4. ``evaluate``: greedy exact-match accuracy on the held-out problems (``accuracy: NN.N%``) and sample chats.
5. save to ``runs/quickstart``: a Hugging Face folder that ``astrai.load`` loads and ``astrai serve`` serves.
"""
