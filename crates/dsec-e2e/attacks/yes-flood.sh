# `yes` into stdout for 60 s: the output kept is bounded by the exec's output ring (the
# test checks the size of what it received and the node's memory).
timeout 60 yes
echo
echo "contained: yes ran 60 s"
