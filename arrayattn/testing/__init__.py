"""arrayattn.testing: check any attention implementation against arrayattn's contract.
(placeholder)"""
