"""Many sequences at once: a paged KV cache, a scheduler with continuous batching, and the engine that runs them.

- `blocks`: the pool of fixed-size KV blocks and each sequence's block table (bookkeeping only; the lane owns
  the storage);
- `sequence`: a request, the state of its sequence, and the events it reports;
- `stops`: the text a sequence shows, cut at the first stop string;
- `scheduler`: which sequences run in the next step and with which rows (decode rows first, then prefill chunks);
- `lane`: what a lane implements to take part ("step these sequences");
- `cpu`: the cpu lane's implementation; `lanes`: the table of the lanes that have one;
- `sizing`: how many blocks the pool gets;
- `engine`: the loop that steps the scheduler's plan on a lane, in a thread of its own or until idle;
- `batch`: `Model.generate_batch`, a list of prompts run together.
"""
