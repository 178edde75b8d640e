# Raw and packet sockets need CAP_NET_RAW, which sandboxes do not have.
import socket

for name, args in [("raw IPv4", (socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)),
                   ("packet", (socket.AF_PACKET, socket.SOCK_RAW, 0))]:
    try:
        socket.socket(*args).close()
        print(f"escaped: opened a {name} socket")
    except PermissionError as e:
        print(f"contained: {name} socket denied ({e.strerror})")
