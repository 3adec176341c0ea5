"""pipeline.executors on the embedded session and real sockets: what Spark lists, and the TCP probe that
tells a live executor from one on a host that was cut off."""
import socket

from pipeline.executors import ClusterView, Executor, cluster_view, is_local_master, unreachable


def test_a_local_session_lists_no_executors_besides_the_driver(spark):
    view = cluster_view(spark)
    assert isinstance(view, ClusterView)
    assert view.executors == () and view.total_slots == 0 and view.remote_hosts == []
    assert view.driver == "127.0.0.1"
    assert is_local_master(spark)


def test_the_probe_tells_a_listening_executor_from_one_that_does_not_answer():
    with socket.socket() as listening, socket.socket() as closed:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        closed.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        alive = Executor("1", "127.0.0.1", listening.getsockname()[1], 1)
        gone = Executor("2", "127.0.0.1", closed.getsockname()[1], 2)
        assert unreachable([alive, gone]) == [gone]
    assert unreachable([]) == []


def test_a_view_counts_slots_per_host_and_leaves_out_what_was_given_up():
    view = ClusterView("10.0.0.1", (Executor("1", "10.0.0.11", 1, 2), Executor("2", "10.0.0.12", 1, 1),
                                    Executor("3", "10.0.0.12", 2, 1), Executor("4", "10.0.0.1", 3, 1)))
    assert view.slots == {"10.0.0.11": 2, "10.0.0.12": 2, "10.0.0.1": 1}
    assert view.remote_hosts == ["10.0.0.11", "10.0.0.12"]  # not the driver's own host
    assert view.without({"2", "3"}).slots == {"10.0.0.11": 2, "10.0.0.1": 1}
