"""Generated contracts of Keel. Do not edit: run scripts/gen_protos.py."""
