"""Conversion between kvxfer's domain objects and their protobuf messages.

The only package that touches generated `*_pb2` message classes besides the
gRPC servicers' registration.
"""
