#include "psrun_launcher.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "psclient/client.h"
#include "psd/listen_socket.h"
#include "psd/secret.h"

extern char** environ;

namespace psrun {

int g_signal_pipe[2] = {-1, -1};

void OnSignal(int sig) {
  int saved = errno;
  unsigned char b = static_cast<unsigned char>(sig);
  ssize_t n = write(g_signal_pipe[1], &b, 1);
  (void)n;
  errno = saved;
}

namespace {

// Writes all of `s` to `fd` (one write in the common case, so lines never interleave).
void WriteAll(int fd, const std::string& s) {
  size_t off = 0;
  while (off < s.size()) {
    ssize_t n = write(fd, s.data() + off, s.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // a closed terminal or pipe: the output is dropped, the job goes on
    off += static_cast<size_t>(n);
  }
}

void Say(const std::string& msg) { WriteAll(2, "[psrun] " + msg + "\n"); }

// "exited with status 3" / "was killed by signal 9 (Killed)".
std::string Describe(int status) {
  if (WIFSIGNALED(status)) {
    return "was killed by signal " + std::to_string(WTERMSIG(status)) + " (" + strsignal(WTERMSIG(status)) + ")";
  }
  return "exited with status " + std::to_string(WEXITSTATUS(status));
}

// The shell's convention: the exit status, or 128 + the signal.
int CodeOf(int status) { return WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status); }

std::string Dirname(const std::string& path) {
  size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

// `arg` as a shell word, on one line (a newline shows as \n): for the log only.
std::string ShellQuoted(const std::string& arg) {
  bool plain = !arg.empty();
  for (char ch : arg) plain &= std::isalnum(static_cast<unsigned char>(ch)) || std::strchr("-_./=:,+@%", ch) != nullptr;
  if (plain) return arg;
  std::string out = "'";
  for (char ch : arg) {
    if (ch == '\'') {
      out += "'\\''";
    } else if (ch == '\n') {
      out += "\\n";
    } else {
      out += ch;
    }
  }
  return out + "'";
}

bool Executable(const std::string& path) { return access(path.c_str(), X_OK) == 0; }

std::string Absolute(const std::string& path) {
  char* r = realpath(path.c_str(), nullptr);
  if (r == nullptr) return path;
  std::string s(r);
  std::free(r);
  return s;
}

}  // namespace

bool Launcher::WriteRandomSecret(const std::string& path, const std::string& what) const {
  std::ifstream rnd("/dev/urandom", std::ios::binary);
  unsigned char bytes[32];
  if (!rnd.read(reinterpret_cast<char*>(bytes), sizeof(bytes))) {
    Say("cannot read /dev/urandom for " + what);
    return false;
  }
  std::string hex;
  for (unsigned char b : bytes) {
    static const char* digits = "0123456789abcdef";
    hex += digits[b >> 4];
    hex += digits[b & 15];
  }
  int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    Say("cannot write " + path + ": " + std::strerror(errno));
    return false;
  }
  WriteAll(fd, hex + "\n");
  close(fd);
  return true;
}

bool Launcher::Setup() {
  if (o_.timeout_s > 0) {
    deadline_ = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(o_.timeout_s * 1000));
  }
  const char* tmp = std::getenv("TMPDIR");
  std::string templ = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/psrun.XXXXXX";
  std::vector<char> buf(templ.begin(), templ.end());
  buf.push_back('\0');
  if (mkdtemp(buf.data()) == nullptr) {
    Say("cannot create a run directory from " + templ + ": " + std::strerror(errno) + "; set TMPDIR");
    return false;
  }
  run_dir_ = buf.data();
  own_run_dir_ = true;
  if (!o_.log_dir.empty()) {
    mkdir(o_.log_dir.c_str(), 0755);
    struct stat st {};
    if (stat(o_.log_dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
      Say("--log-dir " + o_.log_dir + " is not a directory that can be created");
      return false;
    }
  }
  if (o_.auth == "auto") {
    token_file_ = run_dir_ + "/auth-token";
    if (!WriteRandomSecret(token_file_, "--auth auto")) return false;
  } else if (!o_.auth_token_file.empty()) {
    auto token = psd::ReadSecretFile(o_.auth_token_file);
    if (!token.ok()) {
      Say("--auth-token-file: " + token.status().message());
      return false;
    }
    token_file_ = Absolute(o_.auth_token_file);
  }
  if (!o_.tls_dir.empty()) {
    tls_dir_ = Absolute(o_.tls_dir);
    for (const char* f : {"ca.pem", "server.pem", "server.key"}) {
      if (access((tls_dir_ + "/" + f).c_str(), R_OK) != 0) {
        Say("--tls-dir: " + tls_dir_ + "/" + f + " is missing; make the files with deploy/make_tls_certs.sh " +
            o_.tls_dir);
        return false;
      }
    }
  }
  if (o_.cluster.empty() && o_.shards > 1) {
    // The shards' own secret (never the workers'): they prove it to each other on every link.
    cluster_secret_file_ = run_dir_ + "/cluster-secret";
    if (!WriteRandomSecret(cluster_secret_file_, "the cluster secret")) return false;
  }
  if (o_.cluster.empty()) {
    auto psd = FindPsd();
    if (!psd) return false;
    psd_ = *psd;
  }
  return true;
}

std::optional<std::string> Launcher::FindPsd() const {
  if (!o_.psd.empty()) {
    if (Executable(o_.psd)) return o_.psd;
    Say("--psd " + o_.psd + " is not an executable file");
    return std::nullopt;
  }
  std::string self = Absolute("/proc/self/exe");
  std::string dir = Dirname(self);
  for (const std::string& p : {dir + "/psd", dir + "/../server/psd"}) {
    if (Executable(p)) return Absolute(p);
  }
  Say("cannot find psd next to psrun (" + dir + "/psd) or in the build tree (" + dir +
      "/../server/psd); pass --psd PATH");
  return std::nullopt;
}

Child* Launcher::Spawn(const std::string& label, bool shard, int index, const std::vector<std::string>& argv,
                       const std::vector<std::string>& env, bool search_path, int listen_fd) {
  int out[2], err[2];
  if (pipe2(out, O_CLOEXEC) != 0) return nullptr;
  if (pipe2(err, O_CLOEXEC) != 0) {
    close(out[0]);
    close(out[1]);
    return nullptr;
  }
  // Everything the child needs is built before fork (nothing allocates in the child).
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string kv(*e);
    bool contract = kv.rfind("PSD_CLUSTER=", 0) == 0 || kv.rfind("PSD_WORKER_", 0) == 0 ||
                    kv.rfind("PSD_NUM_WORKERS=", 0) == 0 || kv.rfind("PSD_CHIEF_ELIGIBLE=", 0) == 0 ||
                    kv.rfind("PSD_AUTH_TOKEN_FILE=", 0) == 0;
    if (!contract) env_strings.push_back(std::move(kv));  // an outer launcher's contract is not ours
  }
  env_strings.insert(env_strings.end(), env.begin(), env.end());
  std::vector<char*> envp;
  for (auto& e : env_strings) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::string exec_error = "psrun: cannot run '" + argv[0] + "': ";

  // Signals stay blocked across fork until the child has reset their handlers: a SIGTERM for the
  // child arriving before that must kill it, not run psrun's handler in it.
  const pid_t parent = getpid();
  sigset_t all, old;
  sigfillset(&all);
  sigprocmask(SIG_BLOCK, &all, &old);
  pid_t pid = fork();
  if (pid != 0) sigprocmask(SIG_SETMASK, &old, nullptr);
  if (pid < 0) {
    Say("fork: " + std::string(std::strerror(errno)));
    for (int fd : {out[0], out[1], err[0], err[1]}) close(fd);
    return nullptr;
  }
  if (pid == 0) {
    setpgid(0, 0);
    // psrun killed outright (SIGKILL, a crash) still stops its children: they get SIGTERM.
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) _exit(128 + SIGTERM);  // psrun died before the line above
    for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGCHLD, SIGPIPE}) signal(sig, SIG_DFL);
    sigprocmask(SIG_SETMASK, &old, nullptr);
    int devnull = open("/dev/null", O_RDONLY);
    if (devnull >= 0) dup2(devnull, 0);
    dup2(out[1], 1);
    dup2(err[1], 2);
    // The shard's listening socket (above 2: StartShards moved it there), without close-on-exec.
    if (listen_fd >= 0) dup2(listen_fd, kShardListenFd);
    if (listen_fd == kShardListenFd) fcntl(kShardListenFd, F_SETFD, 0);
    if (search_path) {
      execvpe(args[0], args.data(), envp.data());
    } else {
      execve(args[0], args.data(), envp.data());
    }
    const char* why = std::strerror(errno);
    ssize_t n = write(2, exec_error.data(), exec_error.size());
    n = write(2, why, std::strlen(why));
    n = write(2, "\n", 1);
    (void)n;
    _exit(127);
  }
  setpgid(pid, pid);  // also here: no race with a signal sent right after fork
  close(out[1]);
  close(err[1]);
  fcntl(out[0], F_SETFL, O_NONBLOCK);
  fcntl(err[0], F_SETFL, O_NONBLOCK);
  Child& c = children_.emplace_back();
  c.label = label;
  c.shard = shard;
  c.index = index;
  c.pid = pid;
  c.out.fd = out[0];
  c.out.out_fd = 1;
  c.err.fd = err[0];
  c.err.out_fd = 2;
  if (!o_.log_dir.empty()) {
    std::string name = o_.log_dir + "/" + (shard ? "psd-" : "worker-") + std::to_string(index) + ".log";
    c.log_fd = open(name.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  }
  std::string cmd;
  for (const auto& a : argv) cmd += (cmd.empty() ? "" : " ") + ShellQuoted(a);
  Say(label + ": pid " + std::to_string(pid) + ": " + cmd);
  return &c;
}

void Launcher::Emit(Child& c, const Stream& s, const std::string& line) {
  WriteAll(s.out_fd, "[" + c.label + "] " + line + "\n");
  if (c.log_fd >= 0) WriteAll(c.log_fd, line + "\n");
}

void Launcher::Read(Child& c, Stream& s) {
  constexpr size_t kMaxLine = 64 * 1024;  // a longer "line" is cut into pieces
  char buf[16384];
  for (;;) {
    ssize_t n = read(s.fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (n <= 0) {  // end of stream (or an error): the last partial line, then close
      if (!s.buf.empty()) Emit(c, s, s.buf);
      s.buf.clear();
      close(s.fd);
      s.fd = -1;
      return;
    }
    s.buf.append(buf, static_cast<size_t>(n));
    size_t start = 0;
    for (size_t nl; (nl = s.buf.find('\n', start)) != std::string::npos; start = nl + 1) {
      Emit(c, s, s.buf.substr(start, nl - start));
    }
    s.buf.erase(0, start);
    while (s.buf.size() >= kMaxLine) {
      Emit(c, s, s.buf.substr(0, kMaxLine));
      s.buf.erase(0, kMaxLine);
    }
  }
}

void Launcher::Reap() {
  for (;;) {
    int status = 0;
    pid_t pid = waitpid(-1, &status, WNOHANG);
    if (pid <= 0) return;
    for (auto& c : children_) {
      if (c.pid != pid || c.reaped) continue;
      c.reaped = true;
      c.status = status;
      // Its last output first, so the exit message follows it.
      if (c.out.fd >= 0) Read(c, c.out);
      if (c.err.fd >= 0) Read(c, c.err);
      OnExit(c);
    }
  }
}

void Launcher::OnExit(Child& c) {
  const bool ok = WIFEXITED(c.status) && WEXITSTATUS(c.status) == 0;
  if (stopping_ || c.stopped_by_us) {
    Say(c.label + " " + Describe(c.status));
    return;
  }
  if (c.shard && starting_) return;  // StartShards says what happened
  const size_t k = static_cast<size_t>(c.index);
  if (c.shard && !ok && k < restarts_.size() && restarts_[k] < o_.restart_shards) {
    ++restarts_[k];
    c.restarted = true;
    Say(c.label + " " + Describe(c.status) + "; starting it again on the same port (restart " +
        std::to_string(restarts_[k]) + " of --restart-shards " + std::to_string(o_.restart_shards) + ")");
    to_restart_.push_back(c.index);
    return;
  }
  Say(c.label + " " + Describe(c.status) + (ok ? "" : ": read its output above ([" + c.label + "] lines)"));
  if (ok) return;
  Fail(CodeOf(c.status));
  if (o_.on_failure == "stop") StopAll(c.label + " failed (--on-failure stop)");
}

void Launcher::RestartShards() {
  std::vector<int> shards;
  shards.swap(to_restart_);
  for (int k : shards) {
    if (stopping_) return;
    const size_t i = static_cast<size_t>(k);
    if (Spawn("psd " + std::to_string(k), true, k, shard_argv_[i], {}, false, shard_sockets_[i]) == nullptr) {
      Say("psd " + std::to_string(k) + " could not be started again");
      Fail(1);
      if (o_.on_failure == "stop") StopAll("psd " + std::to_string(k) + " could not be started again");
    }
  }
}

void Launcher::Pump(int timeout_ms) {
  std::vector<pollfd> fds;
  std::vector<std::pair<Child*, Stream*>> who;
  fds.push_back({g_signal_pipe[0], POLLIN, 0});
  who.emplace_back(nullptr, nullptr);
  for (auto& c : children_) {
    for (Stream* s : {&c.out, &c.err}) {
      if (s->fd < 0) continue;
      fds.push_back({s->fd, POLLIN, 0});
      who.emplace_back(&c, s);
    }
  }
  auto now = Clock::now();
  for (auto t : {deadline_, kill_at_}) {
    if (t == Clock::time_point::max()) continue;
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(t - now).count() + 1;
    timeout_ms = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(timeout_ms, left)));
  }
  int n = poll(fds.data(), fds.size(), timeout_ms);
  if (n > 0) {
    for (size_t i = 1; i < fds.size(); ++i) {
      if (fds[i].revents != 0 && who[i].second->fd >= 0) Read(*who[i].first, *who[i].second);
    }
    if (fds[0].revents != 0) {
      unsigned char sigs[64];
      ssize_t got = read(g_signal_pipe[0], sigs, sizeof(sigs));
      for (ssize_t i = 0; i < got; ++i) {
        int sig = sigs[i];
        if (sig == SIGCHLD) continue;
        if (!stopping_) {
          Fail(128 + sig);
          StopAll(std::string("got ") + strsignal(sig));
        } else if (!killed_) {
          Say(std::string("got ") + strsignal(sig) + " again: killing everything now");
          kill_at_ = Clock::now();
        }
      }
    }
  }
  Reap();
  RestartShards();
  now = Clock::now();
  // Each deadline is acted on once and then cleared: a past one left set would make every later
  // poll return at once and spin a core for the whole --grace-s.
  if (now >= deadline_) {
    deadline_ = Clock::time_point::max();
    if (!stopping_) {
      Fail(124);
      StopAll("--timeout-s " + std::to_string(static_cast<int64_t>(o_.timeout_s)) + " passed");
    }
  }
  if (now >= kill_at_) {
    kill_at_ = Clock::time_point::max();
    if (!killed_) {
      killed_ = true;
      for (auto& c : children_) {
        if (!c.reaped || c.open()) {
          if (!c.reaped) Say(c.label + " did not stop within --grace-s: SIGKILL");
          kill(-c.pid, SIGKILL);
        }
      }
    }
  }
}

void Launcher::StopAll(const std::string& why) {
  if (!stopping_) Say(why + ": stopping everything psrun started");
  stopping_ = true;
  for (auto& c : children_) {
    // A reaped child whose pipes are still open has subprocesses left in its group (the group
    // id cannot be reused while they live): they are stopped too.
    if (c.reaped && !c.open()) continue;
    c.stopped_by_us = true;
    kill(-c.pid, SIGTERM);
  }
  if (kill_at_ == Clock::time_point::max()) {
    kill_at_ = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(o_.grace_s * 1000));
  }
}

bool Launcher::WorkersRunning() const {
  for (const auto& c : children_) {
    if (!c.shard && !c.reaped) return true;
  }
  return false;
}

bool Launcher::ShardsRunning() const {
  for (const auto& c : children_) {
    if (c.shard && !c.reaped) return true;
  }
  return false;
}

void Launcher::WaitAllReaped() {
  auto give_up = Clock::time_point::max();
  for (;;) {
    bool running = false;
    for (const auto& c : children_) running |= !c.reaped;
    if (!running) break;
    if (killed_ && give_up == Clock::time_point::max()) give_up = Clock::now() + std::chrono::seconds(10);
    if (Clock::now() >= give_up) {
      for (const auto& c : children_) {
        if (!c.reaped) Say(c.label + " (pid " + std::to_string(c.pid) + ") survived SIGKILL; giving up on it");
      }
      break;
    }
    Pump(100);
  }
  // Output still in the pipes; a pipe still open after that is held by a subprocess that
  // outlived its parent: its process group is stopped like the rest (SIGTERM, then SIGKILL).
  auto any_open = [this] {
    for (const auto& c : children_) {
      if (c.open()) return true;
    }
    return false;
  };
  auto until = Clock::now() + std::chrono::milliseconds(200);
  while (any_open() && Clock::now() < until) Pump(20);
  if (any_open()) {
    for (auto& c : children_) {
      if (!c.open() || killed_) continue;
      Say(c.label + ": its subprocesses outlived it: stopping its process group");
      kill(-c.pid, SIGTERM);
    }
    // After the SIGKILL round (killed_; kill_at_ cleared) there is nothing left to wait for but
    // the pipes to close.
    if (!killed_ && kill_at_ == Clock::time_point::max()) {
      kill_at_ = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(o_.grace_s * 1000));
    }
    until = (killed_ ? Clock::now() : std::max(Clock::now(), kill_at_)) + std::chrono::seconds(2);
    while (any_open() && Clock::now() < until) Pump(50);
  }
  for (auto& c : children_) {
    for (Stream* s : {&c.out, &c.err}) {
      if (s->fd < 0) continue;
      if (!s->buf.empty()) Emit(c, *s, s->buf);
      close(s->fd);
      s->fd = -1;
    }
  }
}

Launcher::Started Launcher::StartShards(std::string* cluster) {
  // Every shard's listening socket, bound here on port 0 and inherited by its psd: the ports are
  // the kernel's, so they cannot clash, and they are known before any shard starts. psrun closes
  // its copies once the shards are spawned (a shard that dies then refuses connections).
  std::vector<int> sockets;
  auto close_sockets = [&sockets] {
    for (int fd : sockets) close(fd);
    sockets.clear();
  };
  std::string list;
  for (int k = 0; k < o_.shards; ++k) {
    psd::SocketAddress bound;
    auto fd = psd::ListenTcp("127.0.0.1", 0, &bound);
    // Above the descriptors the child rearranges (0-2, kShardListenFd), for Spawn's dup2.
    int high = fd.ok() ? fcntl(*fd, F_DUPFD_CLOEXEC, 10) : -1;
    const int dup_errno = errno;
    if (fd.ok()) close(*fd);
    if (!fd.ok() || high < 0) {
      Say("cannot listen on 127.0.0.1 for shard " + std::to_string(k) + ": " +
          (fd.ok() ? std::string("fcntl: ") + std::strerror(dup_errno) : fd.status().message()));
      close_sockets();
      return Started::kFailed;
    }
    sockets.push_back(high);
    list += (list.empty() ? "" : ",") + bound.ToString();
  }
  std::vector<std::string> job;
  job.insert(job.end(), {"-R", std::to_string(o_.replicas)});
  if (o_.backup >= 0) {
    job.insert(job.end(), {"-B", std::to_string(o_.backup)});
  } else {
    job.insert(job.end(), {"-N", std::to_string(o_.workers)});
  }
  bool init_tokens = false;
  for (const auto& a : o_.psd_args) init_tokens |= a.rfind("--init-tokens", 0) == 0;
  if (!init_tokens) job.insert(job.end(), {"--init-tokens", "0"});
  job.push_back("--exit-when-done");
  if (!o_.checkpoint_dir.empty()) job.insert(job.end(), {"--checkpoint-dir", o_.checkpoint_dir});
  if (!token_file_.empty()) job.insert(job.end(), {"--auth-token-file", token_file_});
  if (!tls_dir_.empty()) {
    job.insert(job.end(), {"--tls-cert-file", tls_dir_ + "/server.pem", "--tls-key-file", tls_dir_ + "/server.key",
                           "--tls-ca-file", tls_dir_ + "/ca.pem"});
    if (MutualTls()) job.push_back("--tls-require-client-cert");
  }
  if (!cluster_secret_file_.empty()) job.insert(job.end(), {"--cluster-secret-file", cluster_secret_file_});
  job.insert(job.end(), o_.psd_args.begin(), o_.psd_args.end());

  const size_t first = children_.size();
  std::vector<std::string> port_files;
  for (int k = 0; k < o_.shards; ++k) {
    std::string port_file = run_dir_ + "/psd-" + std::to_string(k) + ".port";
    std::remove(port_file.c_str());
    port_files.push_back(port_file);
    std::vector<std::string> argv{psd_, "--listen-fd", std::to_string(kShardListenFd)};
    if (o_.shards > 1) argv.insert(argv.end(), {"--cluster", list, "--shard-index", std::to_string(k)});
    argv.insert(argv.end(), {"--port-file", port_file});
    argv.insert(argv.end(), job.begin(), job.end());
    if (Spawn("psd " + std::to_string(k), true, k, argv, {}, false, sockets[static_cast<size_t>(k)]) == nullptr) {
      close_sockets();
      return Started::kFailed;
    }
    shard_argv_.push_back(std::move(argv));
  }
  if (o_.restart_shards > 0) {
    shard_sockets_.swap(sockets);  // kept for the restarts (closed by Cleanup)
    restarts_.assign(static_cast<size_t>(o_.shards), 0);
  }
  close_sockets();
  // psd writes its --port-file once it serves (older psd: once it listens; the workers' Connect
  // then waits for a forming cluster by itself).
  auto ready_by = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(o_.start_timeout_s * 1000));
  std::vector<bool> ready(o_.shards, false);
  for (;;) {
    Pump(50);
    if (stopping_) return Started::kFailed;  // a signal or --timeout-s
    int waiting = -1;
    for (int k = 0; k < o_.shards; ++k) {
      Child& c = children_[first + k];
      if (c.reaped) {
        Say("psd shard " + std::to_string(k) + " " + Describe(c.status) +
            " before it was ready: read its output above ([psd " + std::to_string(k) + "] lines)" +
            (o_.log_dir.empty() ? "" : " or " + o_.log_dir + "/psd-" + std::to_string(k) + ".log"));
        return Started::kFailed;
      }
      if (!ready[k]) {
        std::ifstream f(port_files[k]);
        int port = 0;
        ready[k] = static_cast<bool>(f >> port) && port > 0;
      }
      if (!ready[k] && waiting < 0) waiting = k;
    }
    if (waiting < 0) break;
    if (Clock::now() >= ready_by) {
      Say("psd shard " + std::to_string(waiting) + " was not ready within --start-timeout-s " +
          std::to_string(static_cast<int64_t>(o_.start_timeout_s)) + " (no " + port_files[waiting] +
          "): read its output above ([psd " + std::to_string(waiting) + "] lines)" +
          (o_.log_dir.empty() ? "" : " or " + o_.log_dir + "/psd-" + std::to_string(waiting) + ".log"));
      return Started::kFailed;
    }
  }
  Say(std::string(o_.shards == 1 ? "psd serves on "
                                 : "psd cluster of " + std::to_string(o_.shards) + " shards serves on ") +
      list);
  *cluster = list;
  return Started::kReady;
}

bool Launcher::StartWorkers(const std::string& cluster) {
  // Worker 0 first: it is the one the contract marks chief-eligible, and the first hello usually
  // makes it psd's chief too.
  for (int i = 0; i < o_.workers; ++i) {
    std::vector<std::string> env{"PSD_CLUSTER=" + cluster, "PSD_WORKER_INDEX=" + std::to_string(i),
                                 "PSD_NUM_WORKERS=" + std::to_string(o_.workers),
                                 "PSD_WORKER_NAME=worker-" + std::to_string(i),
                                 std::string("PSD_CHIEF_ELIGIBLE=") + (i == 0 ? "1" : "0")};
    if (!token_file_.empty()) env.push_back("PSD_AUTH_TOKEN_FILE=" + token_file_);
    if (!tls_dir_.empty()) {
      env.push_back("PSD_TLS_CA_FILE=" + tls_dir_ + "/ca.pem");
      if (MutualTls()) {
        env.push_back("PSD_TLS_CERT_FILE=" + tls_dir_ + "/client.pem");
        env.push_back("PSD_TLS_KEY_FILE=" + tls_dir_ + "/client.key");
      }
    }
    if (Spawn("worker " + std::to_string(i), false, i, o_.command, env, true) == nullptr) return false;
  }
  return true;
}

void Launcher::Supervise() {
  while (WorkersRunning()) Pump(200);
}

void Launcher::DrainShards() {
  if (stopping_ || !ShardsRunning()) return;
  // With --exit-when-done psd exits once every worker has finished; a worker that failed
  // without finishing keeps it waiting (for --worker-grace-s), so the wait is bounded.
  auto until = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(o_.shard_exit_s * 1000));
  auto ask_at = Clock::now() + std::chrono::seconds(1);
  while (ShardsRunning() && !stopping_ && Clock::now() < until) {
    Pump(100);
    if (Clock::now() < ask_at || !ShardsRunning() || stopping_) continue;
    ask_at = Clock::time_point::max();
    // A trainer that never joined psd (or left without finishing) leaves it waiting: when no
    // worker is connected any more, nothing will make it exit by itself.
    psclient::ClientOptions opts;
    opts.observer = true;
    opts.connect_timeout_ms = 2000;
    opts.request_timeout_ms = 5000;
    opts.cluster = psclient::ParseClusterList(cluster_);
    if (!token_file_.empty()) {
      auto token = psd::ReadSecretFile(token_file_);
      if (token.ok()) opts.auth_token = *token;
    }
    if (!tls_dir_.empty()) {
      opts.tls_ca_file = tls_dir_ + "/ca.pem";
      if (MutualTls()) {
        opts.tls_cert_file = tls_dir_ + "/client.pem";
        opts.tls_key_file = tls_dir_ + "/client.key";
      }
    }
    auto client = psclient::Client::Connect(opts);
    if (!client.ok()) continue;
    auto status = (*client)->GetStatus();
    if (status.ok() && status->workers_connected == 0) {
      StopAll("no worker is connected to psd any more (" + std::to_string(status->workers_finished) +
              " finished): psd will not exit by itself");
    }
  }
  if (ShardsRunning() && !stopping_) {
    StopAll("the workers are done but psd did not exit within --shard-exit-s " +
            std::to_string(static_cast<int64_t>(o_.shard_exit_s)));
  }
}

int Launcher::Run() {
  if (!Setup()) return 2;
  std::string cluster = o_.cluster;
  if (cluster.empty()) {
    if (StartShards(&cluster) != Started::kReady) {
      Fail(1);
      StopAll("psd did not start");
      WaitAllReaped();
      return exit_code_;
    }
  }
  starting_ = false;
  cluster_ = cluster;
  if (!StartWorkers(cluster)) {
    Fail(1);
    StopAll("a worker could not be started");
  }
  Supervise();
  if (!stopping_) {
    int failed = 0;
    for (const auto& c : children_) failed += !c.shard && CodeOf(c.status) != 0;
    Say(failed == 0 ? "all " + std::to_string(o_.workers) + " workers finished"
                    : std::to_string(o_.workers - failed) + " of " + std::to_string(o_.workers) +
                          " workers finished, " + std::to_string(failed) + " failed");
  }
  DrainShards();
  WaitAllReaped();
  // A shard that failed by itself after the workers succeeded (its final checkpoint, say).
  for (const auto& c : children_) {
    if (c.shard && !c.stopped_by_us && !c.restarted && c.reaped && CodeOf(c.status) != 0) Fail(CodeOf(c.status));
  }
  return exit_code_ < 0 ? 0 : exit_code_;
}

void Launcher::Cleanup() {
  for (int fd : shard_sockets_) close(fd);
  shard_sockets_.clear();
  for (auto& c : children_) {
    if (c.log_fd >= 0) close(c.log_fd);
    c.log_fd = -1;
  }
  if (own_run_dir_) {
    for (const char* name : {"auth-token", "cluster-secret"}) std::remove((run_dir_ + "/" + name).c_str());
    for (int k = 0; k < o_.shards; ++k) {
      std::string f = run_dir_ + "/psd-" + std::to_string(k) + ".port";
      std::remove(f.c_str());
      std::remove((f + ".tmp").c_str());
    }
    rmdir(run_dir_.c_str());
    own_run_dir_ = false;
  }
}

}  // namespace psrun
