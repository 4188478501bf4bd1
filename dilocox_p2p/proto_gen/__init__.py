"""GENERATED protobuf modules (scripts/gen_proto.py). DO NOT EDIT."""
