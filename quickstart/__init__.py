"""The quickstart (``astrai quickstart``, the README's ``make run``): train a small chat model on CPU in minutes.

The flow, end to end, with no downloads:
1. ``task``: generate the bundled synthetic chat task deterministically (2-digit addition, "What is 47 + 85?"
   -> "132", plus optional string tasks) and split it into training problems and held-out problems that never
   appear in training; write the training set as ``{"messages": [...]}`` JSONL for SFT.
2. ``vocab``: build the 100-token character-level tokenizer with the ChatML chat template (eos ``<|im_end|>``).
3. training (``astrai.train``): SFT a 0.87M-parameter decoder (``chat-small``) on the rendered chats, Muon +
   AdamW by default.
4. ``evaluate``: greedy exact-match accuracy on the held-out problems (``accuracy: NN.N%``) and sample chats.
5. save to ``runs/quickstart``: a Hugging Face folder that ``astrai.load`` loads and ``astrai serve`` serves.
6. ``rl`` (``astrai quickstart --rl``): online GRPO from that model on a rephrased question ("What's 47 + 85?")
   with an exact-match reward, printing ``accuracy before RL`` and ``accuracy after RL``.
"""
