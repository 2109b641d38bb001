"""gRPC channel and server options shared by clients and servers (no server-only imports)."""

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]

# A peer that froze (SIGSTOP, a hung host) keeps its TCP connection open and answers nothing: a call
# waiting on it would wait forever. Clients ping while a call is open and give the connection up
# when a ping goes unanswered, so the call fails UNAVAILABLE and is resent elsewhere (replicas,
# docs/replicas.md). Pings are sent however long no data flowed (max_pings_without_data 0).
CLIENT_KEEPALIVE = [
    ("grpc.keepalive_time_ms", 5000),
    ("grpc.keepalive_timeout_ms", 5000),
    ("grpc.http2.max_pings_without_data", 0),
]
# Servers accept those pings (by default they answer pings more often than every 5 minutes without
# data with GOAWAY): at most one a second, never counted as strikes.
SERVER_KEEPALIVE = [
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
    ("grpc.http2.max_ping_strikes", 0),
]
