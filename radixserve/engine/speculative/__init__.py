"""Speculative decoding without a draft model: drafts from a request's own tokens and from its
namespace's earlier sequences (drafter.py), verified exactly by the target model in one row
(verify.py), with a per-request policy saying how many tokens to draft (policy.py)."""
