"""Adapters to other libraries: the trainers (``trl``, ``verl``, ``openrlhf``, ``prime_rl``), each a
package of its peer's names over the shared floor (``common``), and Hugging Face causal LMs on the
fused head (``hf``). ``docs/integrations/`` has one page per trainer."""
