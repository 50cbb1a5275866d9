# Refuses an include that points the wrong way between the daemon's layers (README "Architecture").
# Run at build time (target psd_layer_check) with -DSERVER_DIR=<server/>; fails the build, naming
# the file, the include and the rule it breaks.
#
# Project headers are fenced by the include roots (server/CMakeLists.txt); this also catches the
# system headers a layer must not use, which every target can reach: Asio, Cap'n Proto/KJ, OpenSSL,
# and the wire/ framing.
#
# Rules: layer -> the layers (folders of server/) and psd headers it may include.
cmake_policy(SET CMP0057 NEW)
set(PSD_LAYER_RULES
  "core:core"
  "checkpoint:checkpoint core"
  "config:config core"
  "ops:ops"
  "net:net"
  "cluster:cluster core"
  "service:service net core config ops cluster")
# Header prefixes no file of these layers may include (besides other layers' folders).
set(PSD_LAYER_FORBIDDEN_core "boost/asio;asio;capnp/;kj/;openssl/;wire/;text/;psd.capnp.h")
set(PSD_LAYER_FORBIDDEN_checkpoint "boost/asio;asio;capnp/;kj/;openssl/;wire/;text/;psd.capnp.h")
set(PSD_LAYER_FORBIDDEN_config "capnp/;kj/;openssl/;wire/;psd.capnp.h")
set(PSD_LAYER_FORBIDDEN_ops "capnp/;kj/;psd.capnp.h")
set(PSD_LAYER_FORBIDDEN_cluster "boost/asio;asio;capnp/;kj/;openssl/;wire/;text/;psd.capnp.h;thread")
# The transport reads and writes frames; what they say is the service's.
set(PSD_LAYER_FORBIDDEN_net "psd.capnp.h")

file(GLOB PSD_ALL_LAYERS LIST_DIRECTORIES true RELATIVE ${SERVER_DIR} ${SERVER_DIR}/*)
set(errors "")
foreach(rule IN LISTS PSD_LAYER_RULES)
  string(REPLACE ":" ";" parts "${rule}")
  list(GET parts 0 layer)
  list(GET parts 1 allowed)
  string(REPLACE " " ";" allowed "${allowed}")
  file(GLOB_RECURSE files ${SERVER_DIR}/${layer}/*.h ${SERVER_DIR}/${layer}/*.cc)
  foreach(f IN LISTS files)
    file(STRINGS ${f} includes REGEX "^[ \t]*#[ \t]*include[ \t]*[<\"]")
    foreach(line IN LISTS includes)
      string(REGEX REPLACE "^[ \t]*#[ \t]*include[ \t]*[<\"]([^>\"]*)[>\"].*" "\\1" inc "${line}")
      file(RELATIVE_PATH rel ${SERVER_DIR} ${f})
      # Another layer's folder.
      if(inc MATCHES "^([a-z_]+)/")
        set(top ${CMAKE_MATCH_1})
        if(top IN_LIST PSD_ALL_LAYERS AND IS_DIRECTORY ${SERVER_DIR}/${top} AND NOT top IN_LIST allowed)
          string(APPEND errors "  server/${rel}: #include \"${inc}\": ${layer}/ may use only ${allowed}\n")
        endif()
      elseif(NOT inc MATCHES "/" AND EXISTS ${SERVER_DIR}/${inc})
        string(APPEND errors "  server/${rel}: #include \"${inc}\": ${layer}/ may not use the daemon's top level\n")
      endif()
      foreach(bad IN LISTS PSD_LAYER_FORBIDDEN_${layer})
        string(FIND "${inc}" "${bad}" at)
        if(at EQUAL 0)
          string(APPEND errors "  server/${rel}: #include <${inc}>: ${layer}/ must not depend on ${bad}\n")
        endif()
      endforeach()
    endforeach()
  endforeach()
endforeach()
if(errors)
  message(FATAL_ERROR "The daemon's layering is broken (README \"Architecture\"):\n${errors}"
                      "Move the code to the layer that may depend on it, or pass what it needs in through an interface.")
endif()
