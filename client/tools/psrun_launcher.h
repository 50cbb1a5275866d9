// psrun's launcher (psrun.cc has the command line; README "Launching your job"): the local shards and
// the trainer processes it starts, their output, signals, exits and restarts, in one poll loop.
#ifndef PSCLIENT_TOOLS_PSRUN_LAUNCHER_H_
#define PSCLIENT_TOOLS_PSRUN_LAUNCHER_H_

#include <sys/types.h>
#include <unistd.h>

#include <chrono>
#include <deque>
#include <optional>
#include <string>
#include <vector>

namespace psrun {

// Where a shard finds the listening socket psrun bound for it (`psd --listen-fd 3`).
constexpr int kShardListenFd = 3;

using Clock = std::chrono::steady_clock;

// The self-pipe the signal handler writes each signal to (created by main, read by the Launcher).
extern int g_signal_pipe[2];

// The signal handler main installs: writes the signal to g_signal_pipe.
void OnSignal(int sig);

struct Options {
  int shards = 1;
  int workers = 1;
  int replicas = -1;  // -1: every worker
  int backup = -1;    // -1: --total-replicas = workers
  std::string psd;
  std::vector<std::string> psd_args;
  std::string checkpoint_dir;
  std::string auth_token_file;
  std::string auth;     // "auto": a fresh random token for this run
  std::string tls_dir;  // ca.pem, server.pem/.key [, client.pem/.key] as deploy/make_tls_certs.sh makes them
  std::string cluster;
  std::string log_dir;
  std::string on_failure = "stop";
  double timeout_s = 0;
  double start_timeout_s = 120;
  double grace_s = 15;
  double shard_exit_s = 30;
  int restart_shards = 0;  // restarts of a shard that dies, each
  std::vector<std::string> command;
};

struct Stream {
  int fd = -1;
  int out_fd = 1;  // where prefixed lines go: psrun's stdout or stderr
  std::string buf;
};

struct Child {
  std::string label;  // "psd 0", "worker 2"
  bool shard = false;
  int index = 0;
  pid_t pid = -1;  // also its process group
  Stream out, err;
  int log_fd = -1;
  bool reaped = false;
  int status = 0;
  bool stopped_by_us = false;
  bool restarted = false;  // a shard that died and was started again (--restart-shards)
  bool open() const { return out.fd >= 0 || err.fd >= 0; }
};

class Launcher {
 public:
  explicit Launcher(Options o) : o_(std::move(o)) {}
  ~Launcher() { Cleanup(); }
  int Run();

 private:
  enum class Started { kReady, kFailed };

  bool Setup();
  // Writes 32 random bytes as hex to a new 0600 file; false (said why) on failure.
  bool WriteRandomSecret(const std::string& path, const std::string& what) const;
  std::optional<std::string> FindPsd() const;
  Started StartShards(std::string* cluster);
  bool StartWorkers(const std::string& cluster);
  void Supervise();
  void DrainShards();
  void StopAll(const std::string& why);
  void WaitAllReaped();

  // `listen_fd` >= 0: the child gets that socket as its descriptor kShardListenFd (psrun keeps
  // its own copy; the caller closes it).
  Child* Spawn(const std::string& label, bool shard, int index, const std::vector<std::string>& argv,
               const std::vector<std::string>& env, bool search_path, int listen_fd = -1);
  // One round of the event loop: output, signals, exits, deadlines. Waits at most timeout_ms.
  void Pump(int timeout_ms);
  void Read(Child& c, Stream& s);
  void Emit(Child& c, const Stream& s, const std::string& line);
  void Reap();
  void OnExit(Child& c);
  // --restart-shards: starts the shards that died again (after Reap: Spawn adds to children_).
  void RestartShards();
  void Fail(int code) {
    if (exit_code_ < 0) exit_code_ = code;
  }
  bool WorkersRunning() const;
  bool ShardsRunning() const;
  void Cleanup();

  Options o_;
  std::deque<Child> children_;  // a deque: references stay valid as children are added
  std::string run_dir_;
  bool own_run_dir_ = false;
  std::string token_file_;
  std::string tls_dir_;  // absolute --tls-dir ("": no TLS)
  // --tls-dir holds a client certificate: psd requires one, and the workers present it.
  bool MutualTls() const { return access((tls_dir_ + "/client.pem").c_str(), R_OK) == 0; }
  std::string cluster_secret_file_;  // shards > 1: a fresh secret for their links
  std::string psd_;
  std::string cluster_;  // PSD_CLUSTER
  // --restart-shards: each shard's command and listening socket (kept open: a restarted shard
  // serves on the same port), its restarts so far, and the shards waiting to be started again.
  std::vector<std::vector<std::string>> shard_argv_;
  std::vector<int> shard_sockets_;
  std::vector<int> restarts_;
  std::vector<int> to_restart_;
  int exit_code_ = -1;  // the first failure's code (or 128 + signal, 124 on --timeout-s)
  bool stopping_ = false;
  bool starting_ = true;
  Clock::time_point deadline_ = Clock::time_point::max();  // --timeout-s
  Clock::time_point kill_at_ = Clock::time_point::max();   // SIGKILL what SIGTERM did not stop
  bool killed_ = false;
};

}  // namespace psrun

#endif  // PSCLIENT_TOOLS_PSRUN_LAUNCHER_H_
