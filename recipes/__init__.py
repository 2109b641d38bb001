"""Post-training recipes that run through the Temper client against a local stack.

Each is a module runnable as ``python -m recipes.<name>``:

- ``rl_arithmetic``: GRPO-style RL (importance_sampling or ppo) on exactly-scored addition;
- ``dpo``: DPO via forward_backward_custom on the trajectory-judge pairs;
- ``distill``: on-policy (reverse-KL) distillation from a teacher sampling client.
"""
