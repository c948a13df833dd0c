"""Generated protobuf / gRPC code for kvxfer.v1 (scripts/gen_proto.sh); do not edit."""
